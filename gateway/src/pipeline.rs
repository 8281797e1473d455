//! Token ids in, API deltas out: the streaming detokenizer, then stop
//! strings (matched on text across token boundaries, never emitted), then
//! the reasoning/content split, then tool-call extraction from content.
//! Every engine's output goes through this once, so they all behave the
//! same on the wire.

use text::reasoning::{ReasoningFormat, ReasoningParser, Segment};
use text::stop::StopMatcher;
use text::tools::{ToolCall, ToolEvent, ToolParser};
use text::{StreamDecoder, Tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("cannot detokenize the model's output: {0}")]
    Detokenize(String),
}

/// What the text stages do for one request.
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    pub stop: Vec<String>,
    pub reasoning: ReasoningFormat,
    /// The rendered prompt left a reasoning block open.
    pub starts_in_reasoning: bool,
    /// `Some` when the request offered tools the model may call: the
    /// parser of the family's format, knowing the tools' parameters.
    pub tools: Option<ToolParser>,
    /// Reasoning tokens allowed before the think block is closed for the
    /// model (`Generation` enforces it); `None` for no limit.
    pub thinking_budget: Option<u32>,
}

impl PipelineOptions {
    /// Plain text: no reasoning split, no tools (`/v1/completions`).
    pub fn plain(stop: Vec<String>) -> Self {
        Self {
            stop,
            reasoning: ReasoningFormat::None,
            starts_in_reasoning: false,
            tools: None,
            thinking_budget: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// What one pushed token produced.
#[derive(Debug, Default, PartialEq)]
pub struct Step {
    pub deltas: Vec<Delta>,
    /// A stop string matched: nothing more will be emitted and the engine
    /// should be told to stop.
    pub stopped: bool,
}

pub struct Pipeline {
    decoder: StreamDecoder,
    stop: StopMatcher,
    reasoning: ReasoningParser,
    tools: Option<ToolParser>,
    tokens: u32,
    reasoning_tokens: u32,
    tool_calls: usize,
    flushed: bool,
}

impl Pipeline {
    /// `prompt` lets the first generated token decode in context (a leading
    /// space is kept).
    pub fn new(tokenizer: Tokenizer, prompt: &[u32], options: &PipelineOptions) -> Self {
        Self {
            decoder: StreamDecoder::with_prefix(tokenizer, true, prompt),
            stop: StopMatcher::new(&options.stop),
            reasoning: ReasoningParser::new(options.reasoning, options.starts_in_reasoning),
            tools: options.tools.clone(),
            tokens: 0,
            reasoning_tokens: 0,
            tool_calls: 0,
            flushed: false,
        }
    }

    /// Feeds one generated token.
    pub fn push(&mut self, id: u32) -> Result<Step, PipelineError> {
        let mut step = Step::default();
        if self.flushed {
            step.stopped = self.stop.is_stopped();
            return Ok(step);
        }
        self.tokens += 1;
        let was_reasoning = self.reasoning.in_reasoning();
        let text = self
            .decoder
            .push(id)
            .map_err(|e| PipelineError::Detokenize(e.to_string()))?;
        let passed = self.stop.push(&text);
        self.feed(&passed.text, &mut step.deltas);
        // Tag tokens and everything inside the block count as reasoning.
        if was_reasoning || self.reasoning.in_reasoning() {
            self.reasoning_tokens += 1;
        }
        if passed.stopped {
            self.settle(&mut step.deltas);
            step.stopped = true;
        }
        Ok(step)
    }

    /// Generation ended: releases everything held back by any stage.
    pub fn finish(&mut self) -> Result<Vec<Delta>, PipelineError> {
        let mut out = Vec::new();
        if self.flushed {
            return Ok(out);
        }
        let tail = self
            .decoder
            .finish()
            .map_err(|e| PipelineError::Detokenize(e.to_string()))?;
        let passed = self.stop.push(&tail);
        self.feed(&passed.text, &mut out);
        if !passed.stopped {
            let held = self.stop.finish();
            self.feed(&held, &mut out);
        }
        self.settle(&mut out);
        Ok(out)
    }

    /// Generated tokens seen so far.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// Inside a reasoning block now.
    pub fn in_reasoning(&self) -> bool {
        self.reasoning.in_reasoning()
    }

    pub fn reasoning_tokens(&self) -> u32 {
        self.reasoning_tokens
    }

    pub fn tool_calls(&self) -> usize {
        self.tool_calls
    }

    fn feed(&mut self, text: &str, out: &mut Vec<Delta>) {
        if text.is_empty() {
            return;
        }
        let segments = self.reasoning.push(text);
        self.route_segments(segments, out);
    }

    /// Flushes the reasoning and tool stages; nothing is emitted after this.
    fn settle(&mut self, out: &mut Vec<Delta>) {
        let segments = self.reasoning.finish();
        self.route_segments(segments, out);
        if let Some(tools) = &mut self.tools {
            let events = match tools.finish() {
                Ok(events) => events,
                // An unfinished call is given back as the text it was.
                Err(unfinished) => vec![ToolEvent::Content(unfinished.into_raw())],
            };
            self.route_tool_events(events, out);
        }
        self.flushed = true;
    }

    fn route_segments(&mut self, segments: Vec<Segment>, out: &mut Vec<Delta>) {
        for segment in segments {
            match segment {
                Segment::Reasoning(t) => push_delta(out, Delta::Reasoning(t)),
                Segment::Content(t) => match &mut self.tools {
                    Some(tools) => {
                        let events = tools.push(&t);
                        self.route_tool_events(events, out);
                    }
                    None => push_delta(out, Delta::Content(t)),
                },
            }
        }
    }

    fn route_tool_events(&mut self, events: Vec<ToolEvent>, out: &mut Vec<Delta>) {
        for event in events {
            match event {
                ToolEvent::Content(t) => push_delta(out, Delta::Content(t)),
                ToolEvent::Call(call) => {
                    self.tool_calls += 1;
                    out.push(Delta::ToolCall(call));
                }
            }
        }
    }
}

/// Appends, merging with the previous delta of the same text kind so a step
/// yields as few chunks as possible.
pub fn push_delta(out: &mut Vec<Delta>, delta: Delta) {
    match (out.last_mut(), delta) {
        (_, Delta::Content(t) | Delta::Reasoning(t)) if t.is_empty() => {}
        (Some(Delta::Content(prev)), Delta::Content(t)) => prev.push_str(&t),
        (Some(Delta::Reasoning(prev)), Delta::Reasoning(t)) => prev.push_str(&t),
        (_, delta) => out.push(delta),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fixtures::tokenizer::write_tokenizer;
    use fixtures::Family;
    use text::tools::ToolFormat;

    fn tokenizer(family: Family) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), family, 512).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    /// Runs `text`'s tokens through a pipeline one at a time and joins what
    /// comes out by kind.
    fn run(
        family: Family,
        text: &str,
        options: PipelineOptions,
    ) -> (String, String, Vec<ToolCall>, bool, Pipeline) {
        let (_dir, tok) = tokenizer(family);
        let ids = tok.encode(text, false).unwrap();
        assert!(ids.len() > 1, "want several tokens for {text:?}");
        let mut p = Pipeline::new(tok, &[], &options);
        let mut deltas = Vec::new();
        let mut stopped = false;
        for id in ids {
            let step = p.push(id).unwrap();
            deltas.extend(step.deltas);
            if step.stopped {
                stopped = true;
                break;
            }
        }
        deltas.extend(p.finish().unwrap());
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        for d in deltas {
            match d {
                Delta::Content(t) => content.push_str(&t),
                Delta::Reasoning(t) => reasoning.push_str(&t),
                Delta::ToolCall(c) => calls.push(c),
            }
        }
        (content, reasoning, calls, stopped, p)
    }

    #[test]
    fn stop_string_across_tokens_never_leaks() {
        let opts = PipelineOptions::plain(vec!["brown fox".into()]);
        let (content, _, _, stopped, _) = run(Family::Qwen3, "the quick brown fox jumps", opts);
        assert!(stopped);
        assert_eq!(content, "the quick ");
    }

    #[test]
    fn held_back_partial_stop_is_released_at_the_end() {
        let opts = PipelineOptions::plain(vec!["jumps over".into()]);
        let (content, _, _, stopped, _) = run(Family::Qwen3, "the quick brown fox jumps", opts);
        assert!(!stopped);
        assert_eq!(content, "the quick brown fox jumps");
    }

    #[test]
    fn reasoning_split_and_counts() {
        let opts = PipelineOptions {
            stop: vec![],
            reasoning: ReasoningFormat::Think,
            starts_in_reasoning: false,
            tools: None,
            thinking_budget: None,
        };
        let (content, reasoning, _, _, p) = run(
            Family::Qwen3,
            "<think>\nadd them\n</think>\n\nThe answer is 4",
            opts,
        );
        assert_eq!(reasoning, "add them\n");
        assert_eq!(content, "The answer is 4");
        assert!(p.reasoning_tokens() >= 3, "{}", p.reasoning_tokens());
        assert!(p.reasoning_tokens() < p.tokens());
    }

    #[test]
    fn starts_in_reasoning_when_the_prompt_opened_it() {
        let opts = PipelineOptions {
            stop: vec![],
            reasoning: ReasoningFormat::Think,
            starts_in_reasoning: true,
            tools: None,
            thinking_budget: None,
        };
        let (content, reasoning, _, _, _) = run(Family::Qwen3, "hmm</think>fine", opts);
        assert_eq!((reasoning.as_str(), content.as_str()), ("hmm", "fine"));
    }

    #[test]
    fn hermes_tool_call_extracted_on_the_response_path() {
        let opts = PipelineOptions {
            stop: vec![],
            reasoning: ReasoningFormat::Think,
            starts_in_reasoning: false,
            tools: Some(ToolParser::new(ToolFormat::Hermes)),
            thinking_budget: None,
        };
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, _, calls, _, p) = run(Family::Qwen3, text, opts);
        assert_eq!(content.trim(), "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        let args: serde_json::Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, serde_json::json!({"city": "Paris"}));
        assert!(calls[0].id.starts_with("call_"));
        assert_eq!(p.tool_calls(), 1);
    }

    #[test]
    fn llama_json_tool_call() {
        let opts = PipelineOptions {
            stop: vec![],
            reasoning: ReasoningFormat::None,
            starts_in_reasoning: false,
            tools: Some(ToolParser::new(ToolFormat::Llama3Json)),
            thinking_budget: None,
        };
        let text = "{\"name\": \"lookup\", \"parameters\": {\"q\": \"rust\"}}";
        let (content, _, calls, _, _) = run(Family::Llama, text, opts);
        assert_eq!(content, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "lookup");
    }

    #[test]
    fn unfinished_tool_call_comes_back_as_content() {
        let opts = PipelineOptions {
            stop: vec![],
            reasoning: ReasoningFormat::None,
            starts_in_reasoning: false,
            tools: Some(ToolParser::new(ToolFormat::Hermes)),
            thinking_budget: None,
        };
        let text = "ok <tool_call>\n{\"name\": \"f\", \"argu";
        let (content, _, calls, _, _) = run(Family::Qwen3, text, opts);
        assert!(calls.is_empty());
        assert_eq!(content, text);
    }

    #[test]
    fn tool_tags_without_tools_are_plain_content() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let (content, _, calls, _, _) = run(Family::Qwen3, text, PipelineOptions::plain(vec![]));
        assert!(calls.is_empty());
        assert_eq!(content, text);
    }
}
