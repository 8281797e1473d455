//! Why a policy was rejected. Every semantic error says where it is (the
//! rule by name and index, or the policy itself) and which field, so an
//! operator can fix the file from the log line alone.

use std::fmt;
use std::path::PathBuf;

/// Where in the policy an error sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum At {
    /// The policy's own fields (`default`, `fallback`).
    Policy,
    /// A rule, by 0-based index into `rules` and its name when it has one.
    Rule { index: usize, name: Option<String> },
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            At::Policy => f.write_str("policy"),
            At::Rule {
                index,
                name: Some(name),
            } => write!(f, "rule `{name}` (rules[{index}])"),
            At::Rule { index, name: None } => write!(f, "rules[{index}]"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot read policy file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("policy YAML is malformed: {0}")]
    Yaml(#[from] serde_yaml::Error),

    #[error("config has no top-level `policy:` section")]
    MissingPolicy,

    #[error("{at}: missing field `{field}`")]
    MissingField { at: At, field: &'static str },

    #[error("rules[{index}]: rule name is empty")]
    EmptyRuleName { index: usize },

    #[error("rule `{name}` (rules[{index}]): `default` is reserved for the no-rule-matched route")]
    ReservedRuleName { name: String, index: usize },

    #[error("rule `{name}` (rules[{second}]): duplicate rule name, first used by rules[{first}]")]
    DuplicateRuleName {
        name: String,
        first: usize,
        second: usize,
    },

    #[error(
        "{at}: field `{field}`: unknown signal `{signal}`; known: {}, all, any, not",
        crate::compile::SIGNAL_KEYS
    )]
    UnknownSignal {
        at: At,
        field: String,
        signal: String,
    },

    #[error("{at}: field `{field}`: unknown operator `{op}`; expected one of {expected}")]
    UnknownOperator {
        at: At,
        field: String,
        op: String,
        expected: &'static str,
    },

    #[error("{at}: field `{field}`: expected {expected}, got {got}")]
    WrongType {
        at: At,
        field: String,
        expected: &'static str,
        got: String,
    },

    #[error("{at}: field `{field}`: {reason}")]
    InvalidValue {
        at: At,
        field: String,
        reason: String,
    },

    #[error("{at}: field `{field}`: engine `{engine}` is not loaded (loaded: {loaded})")]
    UnknownEngine {
        at: At,
        field: String,
        engine: String,
        loaded: String,
    },
}
