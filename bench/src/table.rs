//! Markdown tables comparing several runs level by level, with ratio
//! columns such as `ours-default / mlx_lm` or `ours-default / best of
//! (ours-batched, ours-fastpath)`.

use std::collections::BTreeSet;
use std::fmt::Write;
use std::str::FromStr;

use anyhow::{bail, Result};

use crate::metric::Metric;
use crate::report::BenchResult;

/// `NUM/DEN` or `NUM/DEN1|DEN2|...` (the best of several runs).
#[derive(Debug, Clone, PartialEq)]
pub struct Ratio {
    pub num: String,
    pub dens: Vec<String>,
}

impl FromStr for Ratio {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let Some((num, dens)) = s.split_once('/') else {
            bail!("a ratio is NUM/DEN or NUM/DEN1|DEN2, got {s:?}");
        };
        let dens: Vec<String> = dens.split('|').map(str::to_owned).collect();
        if num.is_empty() || dens.iter().any(String::is_empty) {
            bail!("a ratio is NUM/DEN or NUM/DEN1|DEN2, got {s:?}");
        }
        Ok(Ratio {
            num: num.to_owned(),
            dens,
        })
    }
}

impl Ratio {
    fn header(&self) -> String {
        match self.dens.as_slice() {
            [one] => format!("{} / {one}", self.num),
            many => format!("{} / best of {}", self.num, many.join(", ")),
        }
    }

    fn value(&self, results: &[BenchResult], metric: Metric, c: usize) -> Option<f64> {
        let at = |label: &str| {
            results
                .iter()
                .find(|r| r.label == label)
                .and_then(|r| r.level(c))
                .and_then(|l| metric.of(l))
        };
        let num = at(&self.num)?;
        let den = self
            .dens
            .iter()
            .filter_map(|d| at(d))
            .reduce(|a, b| metric.best(a, b))?;
        (den > 0.0).then(|| num / den)
    }
}

pub fn markdown(results: &[BenchResult], ratios: &[Ratio]) -> String {
    let levels: BTreeSet<usize> = results
        .iter()
        .flat_map(|r| r.levels.iter().map(|l| l.concurrency))
        .collect();
    let mut out = String::new();
    for metric in Metric::TABLES {
        let direction = if metric.higher_is_better() {
            "higher is better"
        } else {
            "lower is better"
        };
        let _ = writeln!(out, "{} ({direction})\n", metric.title());
        let mut header = vec!["c".to_owned()];
        header.extend(results.iter().map(|r| r.label.clone()));
        header.extend(ratios.iter().map(Ratio::header));
        row(&mut out, &header);
        row(&mut out, &vec!["---".to_owned(); header.len()]);
        for &c in &levels {
            let mut cells = vec![c.to_string()];
            for r in results {
                cells.push(
                    r.level(c)
                        .and_then(|l| metric.of(l))
                        .map_or("-".into(), number),
                );
            }
            for ratio in ratios {
                cells.push(
                    ratio
                        .value(results, metric, c)
                        .map_or("-".into(), |x| format!("{x:.2}x")),
                );
            }
            row(&mut out, &cells);
        }
        out.push('\n');
    }
    errors(&mut out, results, &levels);
    out
}

/// Failed requests, when any run had some.
fn errors(out: &mut String, results: &[BenchResult], levels: &BTreeSet<usize>) {
    if results
        .iter()
        .all(|r| r.levels.iter().all(|l| l.errors == 0))
    {
        return;
    }
    let _ = writeln!(out, "Failed requests (failed/sent, by kind)\n");
    let mut header = vec!["c".to_owned()];
    header.extend(results.iter().map(|r| r.label.clone()));
    row(out, &header);
    row(out, &vec!["---".to_owned(); header.len()]);
    for &c in levels {
        let mut cells = vec![c.to_string()];
        for r in results {
            cells.push(r.level(c).map_or("-".into(), |l| {
                if l.errors == 0 {
                    format!("0/{}", l.requests)
                } else {
                    let kinds: Vec<String> = l
                        .error_kinds
                        .iter()
                        .map(|(k, n)| format!("{k}: {n}"))
                        .collect();
                    format!("{}/{} ({})", l.errors, l.requests, kinds.join(", "))
                }
            }));
        }
        row(out, &cells);
    }
    out.push('\n');
}

fn row(out: &mut String, cells: &[String]) {
    let _ = writeln!(out, "| {} |", cells.join(" | "));
}

fn number(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::record::RequestRecord;
    use crate::report::{Level, Settings, SCHEMA};
    use crate::request::Endpoint;

    pub fn result(label: &str, tok_s: &[(usize, f64)]) -> BenchResult {
        let levels = tok_s
            .iter()
            .map(|&(c, tokens)| {
                let record = RequestRecord {
                    error: None,
                    ttft: Some(0.1 * c as f64),
                    itl: vec![0.01],
                    e2e: 1.0,
                    output_tokens: tokens as u64,
                    prompt_tokens: None,
                    engine: None,
                };
                Level::from_records(c, &[record], 1.0)
            })
            .collect();
        BenchResult {
            schema: SCHEMA.into(),
            label: label.into(),
            url: "http://x".into(),
            settings: Settings {
                endpoint: Endpoint::Completions,
                model: None,
                prompt_set: "random".into(),
                input_words: 8,
                input_jitter: 0.0,
                max_tokens: 8,
                ignore_eos: false,
                temperature: 0.0,
                tools: false,
                seed: 0,
                request_seeds: None,
                first_prompt: 0,
                amount: "requests 1".into(),
                warmup: vec![],
            },
            started_unix_s: 0,
            levels,
        }
    }

    #[test]
    fn ratios_parse_and_pick_the_best_denominator() {
        assert!("a".parse::<Ratio>().is_err() && "a/".parse::<Ratio>().is_err());
        let r: Ratio = "p/a|b".parse().unwrap();
        assert_eq!(r.dens, vec!["a", "b"]);
        let results = vec![
            result("p", &[(1, 30.0), (2, 50.0)]),
            result("a", &[(1, 20.0), (2, 60.0)]),
            result("b", &[(1, 25.0)]),
        ];
        assert_eq!(r.value(&results, Metric::OutputTokS, 1), Some(30.0 / 25.0));
        assert_eq!(r.value(&results, Metric::OutputTokS, 2), Some(50.0 / 60.0));
        let table = markdown(&results, &[r]);
        assert!(
            table.contains("| c | p | a | b | p / best of a, b |"),
            "{table}"
        );
        assert!(
            table.contains("| 1 | 30.0 | 20.0 | 25.0 | 1.20x |"),
            "{table}"
        );
        assert!(table.contains("| 2 | 50.0 | 60.0 | - | 0.83x |"), "{table}");
        assert!(table.contains("TTFT p50 (ms) (lower is better)"));
        assert!(!table.contains("Failed requests"));
    }
}
