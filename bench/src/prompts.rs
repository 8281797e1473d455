//! Prompt sets. Prompt `i` is a pure function of the set and `i`, so every
//! server in a comparison gets the same prompts in the same order.

use std::path::Path;

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::Value;

/// The bundled set of hand-written prompts: prose, code, JSON, math and
/// tool calls (with their `tools`).
pub const MIXED: &str = include_str!("../prompts/mixed.jsonl");

/// Common English words: one token each in large English-trained
/// vocabularies, two or three in the generated models' small ones.
const WORDS: &str = include_str!("../prompts/words.txt");

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Prompt {
    pub kind: String,
    pub prompt: String,
    /// OpenAI tool definitions offered with this prompt (chat only).
    #[serde(default)]
    pub tools: Option<Value>,
}

#[derive(Debug, Clone)]
pub enum PromptSet {
    /// Random words, a seeded length per prompt.
    Random(RandomWords),
    /// A fixed list, cycled.
    List(Vec<Prompt>),
}

#[derive(Debug, Clone)]
pub struct RandomWords {
    words: Vec<&'static str>,
    /// Mean length in words.
    pub len: usize,
    /// Lengths are uniform in `len * (1 ± jitter)`.
    pub jitter: f64,
    pub seed: u64,
}

impl RandomWords {
    pub fn new(len: usize, jitter: f64, seed: u64) -> Self {
        RandomWords {
            words: WORDS.split_whitespace().collect(),
            len,
            jitter: jitter.clamp(0.0, 1.0),
            seed,
        }
    }

    pub fn prompt(&self, i: usize) -> Prompt {
        let mut rng =
            StdRng::seed_from_u64(self.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let spread = (self.len as f64 * self.jitter).round() as usize;
        let len = rng
            .random_range(self.len.saturating_sub(spread)..=self.len + spread)
            .max(1);
        let text: Vec<&str> = (0..len)
            .map(|_| self.words[rng.random_range(0..self.words.len())])
            .collect();
        Prompt {
            kind: "random".into(),
            prompt: text.join(" "),
            tools: None,
        }
    }
}

impl PromptSet {
    /// `random`, `mixed` (the bundled set) or the path of a JSONL file of
    /// `{"kind", "prompt", "tools"?}` objects.
    pub fn named(name: &str, random: RandomWords) -> Result<PromptSet> {
        match name {
            "random" => Ok(PromptSet::Random(random)),
            "mixed" => Ok(PromptSet::List(parse_jsonl(MIXED)?)),
            path => {
                let text = std::fs::read_to_string(Path::new(path))
                    .with_context(|| format!("read prompt set {path}"))?;
                Ok(PromptSet::List(
                    parse_jsonl(&text).with_context(|| format!("prompt set {path}"))?,
                ))
            }
        }
    }

    /// Prompt `i`. A listed prompt seen again gets a short prefix naming
    /// its round, so repeats do not turn into prefix-cache hits.
    pub fn get(&self, i: usize) -> Prompt {
        match self {
            PromptSet::Random(r) => r.prompt(i),
            PromptSet::List(list) => {
                let mut p = list[i % list.len()].clone();
                let round = i / list.len();
                if round > 0 {
                    p.prompt = format!("[{round}] {}", p.prompt);
                }
                p
            }
        }
    }
}

fn parse_jsonl(text: &str) -> Result<Vec<Prompt>> {
    let prompts = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| serde_json::from_str(l).with_context(|| format!("line {}", n + 1)))
        .collect::<Result<Vec<Prompt>>>()?;
    if prompts.is_empty() {
        bail!("no prompts");
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_are_seeded_and_within_the_jitter() {
        let set = RandomWords::new(100, 0.25, 7);
        assert_eq!(set.prompt(3), set.prompt(3));
        assert_ne!(set.prompt(3), set.prompt(4));
        assert_ne!(set.prompt(3), RandomWords::new(100, 0.25, 8).prompt(3));
        for i in 0..50 {
            let n = set.prompt(i).prompt.split(' ').count();
            assert!((75..=125).contains(&n), "{n}");
        }
        let exact = RandomWords::new(64, 0.0, 0);
        assert!((0..10).all(|i| exact.prompt(i).prompt.split(' ').count() == 64));
    }

    #[test]
    fn bundled_set_has_every_kind_and_tools_where_needed() {
        let PromptSet::List(list) = PromptSet::named("mixed", RandomWords::new(1, 0.0, 0)).unwrap()
        else {
            panic!("a list");
        };
        for kind in ["prose", "code", "json", "math", "tool_call"] {
            assert!(list.iter().any(|p| p.kind == kind), "{kind}");
        }
        assert!(list
            .iter()
            .all(|p| (p.kind == "tool_call") == p.tools.as_ref().is_some_and(|t| t.is_array())));
        let set = PromptSet::List(list.clone());
        assert_eq!(set.get(0), list[0]);
        assert_eq!(
            set.get(list.len()).prompt,
            format!("[1] {}", list[0].prompt)
        );
    }
}
