//! The facts a routing decision is made from: what the request asks for and
//! how loaded the engines are right now.

use std::collections::HashMap;

/// One request's view of the world, built by the gateway per request.
///
/// Per-engine maps are keyed by engine name. A loaded engine missing from
/// `engine_active` / `engine_queued` counts as 0 (nothing reported means
/// nothing running). A missing `engine_accept_rate` or `engine_speedup`
/// entry means *unknown*
/// (no drafts measured yet), which is different from 0.0: see the crate
/// docs for how unknown values compare.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Signals {
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    /// Plain greedy decoding (temperature 0, no sampling knobs).
    pub greedy: bool,
    pub has_tools: bool,
    pub has_images: bool,
    /// Requests running on all engines together.
    pub total_active: u64,
    /// Requests waiting for admission on all engines together.
    pub total_queued: u64,
    pub engine_active: HashMap<String, u64>,
    pub engine_queued: HashMap<String, u64>,
    /// Moving-window draft acceptance rate in 0..=1, for speculative engines.
    pub engine_accept_rate: HashMap<String, f64>,
    /// Moving-window speed of a speculative engine relative to plain
    /// decoding (tokens per target forward x decode-step cost / round
    /// cost): above 1.0 speculation pays. Missing means unknown.
    pub engine_speedup: HashMap<String, f64>,
    /// Allocated KV blocks over total blocks, in 0..=1.
    pub kv_pressure: f64,
    /// The model the request names.
    pub model: String,
}

/// Signals as written in a policy test case or an explained request: a
/// mapping of signal names (the same names conditions use) to values.
/// Unset signals keep their default: an idle server (nothing running or
/// queued, no KV in use, no speculative measurement yet) and a request of
/// zero tokens, sampled (`greedy: false`), without tools or images.
/// An unknown name is an error that YAML reports with its line.
impl<'de> serde::Deserialize<'de> for Signals {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(SignalsVisitor)
    }
}

struct SignalsVisitor;

impl<'de> serde::de::Visitor<'de> for SignalsVisitor {
    type Value = Signals;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a mapping of signal names to values")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Signals, A::Error> {
        use serde::de::Error;
        let mut s = Signals::default();
        while let Some(SignalKey(key)) = map.next_key()? {
            match key.as_str() {
                "prompt_tokens" => s.prompt_tokens = map.next_value()?,
                "max_tokens" => s.max_tokens = map.next_value()?,
                "greedy" => s.greedy = map.next_value()?,
                "has_tools" => s.has_tools = map.next_value()?,
                "has_images" => s.has_images = map.next_value()?,
                "total_active" => s.total_active = map.next_value()?,
                "total_queued" => s.total_queued = map.next_value()?,
                "kv_pressure" => s.kv_pressure = fraction(map.next_value()?, &key)?,
                "model" => s.model = map.next_value()?,
                _ => match key.split_once('.') {
                    Some(("engine_active", e)) if !e.is_empty() => {
                        s.engine_active.insert(e.to_owned(), map.next_value()?);
                    }
                    Some(("engine_queued", e)) if !e.is_empty() => {
                        s.engine_queued.insert(e.to_owned(), map.next_value()?);
                    }
                    Some(("engine_accept_rate", e)) if !e.is_empty() => {
                        let rate = fraction(map.next_value()?, &key)?;
                        s.engine_accept_rate.insert(e.to_owned(), rate);
                    }
                    Some(("engine_speedup", e)) if !e.is_empty() => {
                        let speedup: f64 = map.next_value()?;
                        if !(speedup.is_finite() && speedup >= 0.0) {
                            return Err(A::Error::custom(format!(
                                "`{key}` must be a finite ratio >= 0, got {speedup}"
                            )));
                        }
                        s.engine_speedup.insert(e.to_owned(), speedup);
                    }
                    _ => unreachable!("SignalKey admits only signal names"),
                },
            }
        }
        Ok(s)
    }
}

/// A signal's name, refused as the key is read (so YAML points at its
/// line) when it names no signal.
struct SignalKey(String);

const SIGNALS: &[&str] = &[
    "prompt_tokens",
    "max_tokens",
    "greedy",
    "has_tools",
    "has_images",
    "total_active",
    "total_queued",
    "kv_pressure",
    "model",
];
const PER_ENGINE: &[&str] = &[
    "engine_active",
    "engine_queued",
    "engine_accept_rate",
    "engine_speedup",
];

impl<'de> serde::Deserialize<'de> for SignalKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let key = String::deserialize(d)?;
        let known = SIGNALS.contains(&key.as_str())
            || key
                .split_once('.')
                .is_some_and(|(s, e)| PER_ENGINE.contains(&s) && !e.is_empty());
        if known {
            Ok(SignalKey(key))
        } else {
            Err(serde::de::Error::custom(format!(
                "unknown signal `{key}`; known: {}",
                crate::compile::SIGNAL_KEYS
            )))
        }
    }
}

fn fraction<E: serde::de::Error>(x: f64, key: &str) -> Result<f64, E> {
    if (0.0..=1.0).contains(&x) {
        Ok(x)
    } else {
        Err(E::custom(format!("`{key}` must lie in 0..=1, got {x}")))
    }
}

impl Signals {
    /// The engines the per-engine signals name.
    pub fn engines(&self) -> impl Iterator<Item = &str> {
        self.engine_active
            .keys()
            .chain(self.engine_queued.keys())
            .chain(self.engine_accept_rate.keys())
            .chain(self.engine_speedup.keys())
            .map(String::as_str)
    }

    /// Every signal a condition can read, by its name in conditions, for
    /// showing what a decision was made from.
    pub fn named(&self) -> Vec<(String, String)> {
        let mut out = vec![
            ("model".to_owned(), format!("{:?}", self.model)),
            ("prompt_tokens".to_owned(), self.prompt_tokens.to_string()),
            ("max_tokens".to_owned(), self.max_tokens.to_string()),
            ("greedy".to_owned(), self.greedy.to_string()),
            ("has_tools".to_owned(), self.has_tools.to_string()),
            ("has_images".to_owned(), self.has_images.to_string()),
            ("total_active".to_owned(), self.total_active.to_string()),
            ("total_queued".to_owned(), self.total_queued.to_string()),
            ("kv_pressure".to_owned(), self.kv_pressure.to_string()),
        ];
        let mut per_engine = |name: &str, values: Vec<(&String, String)>| {
            let mut values = values;
            values.sort();
            out.extend(values.into_iter().map(|(e, v)| (format!("{name}.{e}"), v)));
        };
        per_engine(
            "engine_active",
            self.engine_active
                .iter()
                .map(|(e, v)| (e, v.to_string()))
                .collect(),
        );
        per_engine(
            "engine_queued",
            self.engine_queued
                .iter()
                .map(|(e, v)| (e, v.to_string()))
                .collect(),
        );
        per_engine(
            "engine_accept_rate",
            self.engine_accept_rate
                .iter()
                .map(|(e, v)| (e, v.to_string()))
                .collect(),
        );
        per_engine(
            "engine_speedup",
            self.engine_speedup
                .iter()
                .map(|(e, v)| (e, v.to_string()))
                .collect(),
        );
        out
    }
}
