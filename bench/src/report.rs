//! The result file: one run against one server, a level per concurrency.
//! The schema is documented in bench/README.md; `SCHEMA` changes whenever
//! a field changes meaning or goes away.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;
use crate::request::Endpoint;
use crate::stats::Summary;

pub const SCHEMA: &str = "gateway-bench/1";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchResult {
    pub schema: String,
    /// Names this run in plots and tables (`ours-default`, `mlx_lm`...).
    pub label: String,
    pub url: String,
    pub settings: Settings,
    /// Unix time the sweep started.
    pub started_unix_s: u64,
    pub levels: Vec<Level>,
}

/// How the run was driven.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    /// `random`, `mixed` or a file path.
    pub prompt_set: String,
    /// Random prompts: mean length in words, and the spread.
    pub input_words: usize,
    pub input_jitter: f64,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    pub temperature: f64,
    pub tools: bool,
    pub seed: u64,
    /// Request i's sampling seed is this + i (`--request-seeds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_seeds: Option<u64>,
    /// Index of the sweep's first prompt.
    pub first_prompt: usize,
    /// How many requests each level sent: `requests N`, `rounds R (min M)`
    /// or `duration S s`.
    pub amount: String,
    pub warmup: Vec<usize>,
}

/// One concurrency level. Latencies are milliseconds; every summary is
/// over the successful requests only and `null` when there were none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Level {
    pub concurrency: usize,
    /// Requests sent, successful and failed.
    pub requests: usize,
    pub completed: usize,
    pub errors: usize,
    /// Failed requests by kind: `http_<status>`, `connect`, `timeout`,
    /// `broken_stream`, `stream_error`, `bad_chunk`.
    pub error_kinds: BTreeMap<String, usize>,
    /// From the first request sent to the last response ended.
    pub duration_s: f64,
    /// Successful requests over `duration_s`.
    pub requests_per_s: f64,
    /// Output tokens of the successful requests (usage counts when the
    /// server reports them, else output chunks).
    pub output_tokens: u64,
    /// Prompt tokens as the server counted them (0 when it did not say).
    pub prompt_tokens: u64,
    /// Aggregate throughput: `output_tokens / duration_s`.
    pub output_tok_s: f64,
    /// Request sent to first output chunk.
    pub ttft_ms: Option<Summary>,
    /// Gaps between output chunks, over all requests.
    pub itl_ms: Option<Summary>,
    /// Per request: (latency - TTFT) / (output tokens - 1).
    pub tpot_ms: Option<Summary>,
    /// Per request: request sent to the end of the response.
    pub e2e_ms: Option<Summary>,
    /// Per request: output tokens / its latency.
    pub request_output_tok_s: Option<Summary>,
    /// Requests per engine, from our gateway's `x-engine` header.
    pub engines: BTreeMap<String, usize>,
}

impl Level {
    pub fn from_records(concurrency: usize, records: &[RequestRecord], duration_s: f64) -> Level {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
        let mut error_kinds = BTreeMap::new();
        for kind in records.iter().filter_map(|r| r.error.as_ref()) {
            *error_kinds.entry(kind.clone()).or_insert(0) += 1;
        }
        let mut engines = BTreeMap::new();
        for engine in records.iter().filter_map(|r| r.engine.as_ref()) {
            *engines.entry(engine.clone()).or_insert(0) += 1;
        }
        let ms = |v: Vec<f64>| Summary::of(&v.iter().map(|s| s * 1e3).collect::<Vec<_>>());
        let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
        let per_second = |n: f64| {
            if duration_s > 0.0 {
                n / duration_s
            } else {
                0.0
            }
        };
        Level {
            concurrency,
            requests: records.len(),
            completed: ok.len(),
            errors: records.len() - ok.len(),
            error_kinds,
            duration_s,
            requests_per_s: per_second(ok.len() as f64),
            output_tokens,
            prompt_tokens: ok.iter().filter_map(|r| r.prompt_tokens).sum(),
            output_tok_s: per_second(output_tokens as f64),
            ttft_ms: ms(ok.iter().filter_map(|r| r.ttft).collect()),
            itl_ms: ms(ok.iter().flat_map(|r| r.itl.iter().copied()).collect()),
            tpot_ms: ms(ok.iter().filter_map(|r| r.tpot()).collect()),
            e2e_ms: ms(ok.iter().map(|r| r.e2e).collect()),
            request_output_tok_s: Summary::of(
                &ok.iter()
                    .filter_map(|r| r.output_tok_s())
                    .collect::<Vec<_>>(),
            ),
            engines,
        }
    }

    /// A one-line summary for the console.
    pub fn line(&self) -> String {
        let p50 = |s: &Option<Summary>| s.map_or("-".to_owned(), |s| format!("{:.1}", s.p50));
        format!(
            "c={:<3} {:>3}/{:<3} ok  {:>8.1} out tok/s  {:>6.2} req/s  TTFT p50 {:>8} ms  ITL p50 {:>7} ms  TPOT p50 {:>7} ms{}",
            self.concurrency,
            self.completed,
            self.requests,
            self.output_tok_s,
            self.requests_per_s,
            p50(&self.ttft_ms),
            p50(&self.itl_ms),
            p50(&self.tpot_ms),
            if self.error_kinds.is_empty() {
                String::new()
            } else {
                format!("  errors {:?}", self.error_kinds)
            }
        )
    }
}

impl BenchResult {
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(self)? + "\n")
            .with_context(|| format!("write {}", path.display()))
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))
    }

    pub fn level(&self, concurrency: usize) -> Option<&Level> {
        self.levels.iter().find(|l| l.concurrency == concurrency)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ttft: f64, e2e: f64, tokens: u64, engine: &str) -> RequestRecord {
        RequestRecord {
            error: None,
            ttft: Some(ttft),
            itl: vec![(e2e - ttft) / (tokens - 1) as f64; tokens as usize - 1],
            e2e,
            output_tokens: tokens,
            prompt_tokens: Some(10),
            engine: Some(engine.into()),
        }
    }

    #[test]
    fn a_level_counts_only_successes_in_its_metrics() {
        let records = vec![
            ok(0.1, 1.1, 11, "fastpath"),
            ok(0.3, 2.3, 11, "batched"),
            RequestRecord::failed("http_429", std::time::Duration::from_millis(2), None),
        ];
        let level = Level::from_records(2, &records, 2.5);
        assert_eq!((level.requests, level.completed, level.errors), (3, 2, 1));
        assert_eq!(level.error_kinds["http_429"], 1);
        assert_eq!((level.output_tokens, level.prompt_tokens), (22, 20));
        assert!((level.output_tok_s - 8.8).abs() < 1e-9);
        assert!((level.requests_per_s - 0.8).abs() < 1e-9);
        let ttft = level.ttft_ms.unwrap();
        assert!((ttft.p50 - 200.0).abs() < 1e-9 && ttft.count == 2);
        assert_eq!(level.itl_ms.unwrap().count, 20);
        assert!((level.tpot_ms.unwrap().min - 100.0).abs() < 1e-9);
        assert_eq!(level.engines["fastpath"], 1);
        let failed = Level::from_records(1, &records[2..], 0.01);
        assert!(failed.ttft_ms.is_none() && failed.output_tok_s == 0.0);
    }
}
