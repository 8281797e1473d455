//! Policy test cases: a request's signals and the route it must take, so a
//! policy change can be checked before it ships (`gateway policy test`).
//!
//! ```yaml
//! cases:
//!   - name: one greedy request alone takes the fast path
//!     signals: { greedy: true }
//!     engine: fastpath
//!     rule: alone-and-greedy      # optional: the rule that must decide
//!   - name: a busy server batches
//!     signals: { greedy: true, total_active: 3 }
//!     engine: batched
//! ```
//!
//! Unset signals keep [`Signals`]' defaults: an idle server and a request
//! of zero tokens, sampled, without tools or images, naming no model.

use serde::Deserialize;

use crate::policy::Policy;
use crate::signals::Signals;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    pub name: String,
    #[serde(default)]
    pub signals: Signals,
    /// The engine the request must be routed to first.
    pub engine: String,
    /// The rule that must decide (`default` when none matches), if given.
    #[serde(default)]
    pub rule: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseFile {
    cases: Vec<Case>,
}

/// Why a case file cannot be used; YAML errors carry their line.
#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    #[error("{0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("line {line}: {message}")]
    UnknownSignal { line: usize, message: String },
    #[error("case `{case}`: {what} names engine `{engine}`, which the config does not have (engines: {engines})")]
    UnknownEngine {
        case: String,
        what: String,
        engine: String,
        engines: String,
    },
}

/// What a case got.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome<'a> {
    pub engine: &'a str,
    pub rule: &'a str,
    /// Whether it is what the case expects.
    pub pass: bool,
}

/// Reads a case file whose engines (in signals and expectations) must be
/// among `engines`.
pub fn parse_cases(text: &str, engines: &[&str]) -> Result<Vec<Case>, CaseError> {
    let file: CaseFile = serde_yaml::from_str(text).map_err(|e| at_key_line(e, text))?;
    for case in &file.cases {
        let named = case
            .signals
            .engines()
            .map(|e| ("a signal".to_owned(), e))
            .chain(std::iter::once((
                "`engine`".to_owned(),
                case.engine.as_str(),
            )));
        for (what, engine) in named {
            if !engines.contains(&engine) {
                return Err(CaseError::UnknownEngine {
                    case: case.name.clone(),
                    what,
                    engine: engine.to_owned(),
                    engines: engines.join(", "),
                });
            }
        }
    }
    Ok(file.cases)
}

/// YAML places an error inside a mapping at the mapping's start; an
/// unknown signal is named at its own line (the first from there that
/// writes it as a key).
fn at_key_line(e: serde_yaml::Error, text: &str) -> CaseError {
    let message = e.to_string();
    let key = message
        .split_once("unknown signal `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(key, _)| format!("{key}:"));
    let (Some(location), Some(key)) = (e.location(), key) else {
        return CaseError::Yaml(e);
    };
    let line = text
        .lines()
        .enumerate()
        .skip(location.line().saturating_sub(1))
        .find(|(_, l)| l.contains(&key))
        .map_or(location.line(), |(i, _)| i + 1);
    let message = message
        .rsplit_once(" at line ")
        .map_or(message.as_str(), |(m, _)| m)
        .to_owned();
    CaseError::UnknownSignal { line, message }
}

impl Case {
    /// Routes the case's signals with `policy` among the engines that
    /// `takes` the request (the same decision a request gets) and compares.
    pub fn check<'a>(&self, policy: &'a Policy, takes: impl Fn(&str) -> bool) -> Outcome<'a> {
        let d = policy.decide_where(&self.signals, &takes);
        let engine = d.first_where(takes).unwrap_or(d.engine);
        let pass = engine == self.engine && self.rule.as_deref().is_none_or(|r| r == d.rule);
        Outcome {
            engine,
            rule: d.rule,
            pass,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "policy:\n  default: batched\n  rules:\n    - { name: alone, when: { greedy: true, total_active: 0 }, route: fastpath }\n";

    #[test]
    fn cases_route_as_requests_do() {
        let policy = Policy::from_config_yaml(POLICY, &["batched", "fastpath"]).unwrap();
        let cases = parse_cases(
            "cases:\n  - { name: alone, signals: { greedy: true }, engine: fastpath, rule: alone }\n  - { name: busy, signals: { greedy: true, total_active: 2 }, engine: fastpath }\n",
            &["batched", "fastpath"],
        )
        .unwrap();
        assert_eq!(
            cases[0].check(&policy, |_| true),
            Outcome {
                engine: "fastpath",
                rule: "alone",
                pass: true
            }
        );
        assert_eq!(
            cases[1].check(&policy, |_| true),
            Outcome {
                engine: "batched",
                rule: "default",
                pass: false
            }
        );
    }

    #[test]
    fn an_unknown_signal_names_its_line() {
        let text = "cases:\n  - name: typo\n    signals:\n      greedy: true\n      gredy: true\n    engine: batched\n";
        let e = parse_cases(text, &["batched"]).unwrap_err().to_string();
        assert!(
            e.starts_with("line 5: cases[0].signals: unknown signal `gredy`"),
            "{e}"
        );
        let e = parse_cases(
            "cases:\n  - { name: x, signals: { engine_active.dflash: 1 }, engine: batched }\n",
            &["batched"],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("dflash") && e.contains("case `x`"), "{e}");
    }
}
