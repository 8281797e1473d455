//! Compiled conditions and their evaluation. Signal names were resolved to
//! enum variants at load time, so evaluating a rule is a few field reads,
//! at most one hash lookup per per-engine signal, and no allocation.

use crate::signals::Signals;

/// A validated condition tree.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cond {
    All(Box<[Cond]>),
    Any(Box<[Cond]>),
    Not(Box<Cond>),
    Count {
        signal: Count,
        tests: Box<[(Op, u64)]>,
    },
    Measure {
        signal: Measure,
        tests: Box<[(Op, f64)]>,
    },
    Flag {
        signal: Flag,
        value: bool,
    },
    ModelIn(Box<[String]>),
}

/// Integer signals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Count {
    PromptTokens,
    MaxTokens,
    TotalActive,
    TotalQueued,
    EngineActive(Box<str>),
    EngineQueued(Box<str>),
}

/// Real-valued signals that may be unknown: fractions in 0..=1 and
/// non-negative ratios.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Measure {
    KvPressure,
    EngineAcceptRate(Box<str>),
    EngineSpeedup(Box<str>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flag {
    Greedy,
    HasTools,
    HasImages,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Eq,
    Ne,
    Lt,
    Lte,
    Gt,
    Gte,
}

impl Op {
    fn holds<T: PartialOrd>(self, actual: T, bound: T) -> bool {
        match self {
            Op::Eq => actual == bound,
            Op::Ne => actual != bound,
            Op::Lt => actual < bound,
            Op::Lte => actual <= bound,
            Op::Gt => actual > bound,
            Op::Gte => actual >= bound,
        }
    }
}

impl Count {
    fn read(&self, s: &Signals) -> u64 {
        match self {
            Count::PromptTokens => s.prompt_tokens,
            Count::MaxTokens => s.max_tokens,
            Count::TotalActive => s.total_active,
            Count::TotalQueued => s.total_queued,
            // Nothing reported for a loaded engine means nothing running.
            Count::EngineActive(e) => s.engine_active.get(&**e).copied().unwrap_or(0),
            Count::EngineQueued(e) => s.engine_queued.get(&**e).copied().unwrap_or(0),
        }
    }
}

impl Measure {
    /// `None` when unknown; NaN is treated as unknown too, so a broken
    /// measurement cannot satisfy `ne`.
    fn read(&self, s: &Signals) -> Option<f64> {
        let v = match self {
            Measure::KvPressure => s.kv_pressure,
            Measure::EngineAcceptRate(e) => *s.engine_accept_rate.get(&**e)?,
            Measure::EngineSpeedup(e) => *s.engine_speedup.get(&**e)?,
        };
        (!v.is_nan()).then_some(v)
    }
}

impl Flag {
    fn read(self, s: &Signals) -> bool {
        match self {
            Flag::Greedy => s.greedy,
            Flag::HasTools => s.has_tools,
            Flag::HasImages => s.has_images,
        }
    }
}

impl Cond {
    pub(crate) fn matches(&self, s: &Signals) -> bool {
        match self {
            Cond::All(cs) => cs.iter().all(|c| c.matches(s)),
            Cond::Any(cs) => cs.iter().any(|c| c.matches(s)),
            Cond::Not(c) => !c.matches(s),
            Cond::Count { signal, tests } => {
                let v = signal.read(s);
                tests.iter().all(|&(op, bound)| op.holds(v, bound))
            }
            // An unknown value fails every comparison, including `ne`;
            // `not` then inverts that like any other false.
            Cond::Measure { signal, tests } => match signal.read(s) {
                Some(v) => tests.iter().all(|&(op, bound)| op.holds(v, bound)),
                None => false,
            },
            Cond::Flag { signal, value } => signal.read(s) == *value,
            Cond::ModelIn(models) => models.contains(&s.model),
        }
    }
}
