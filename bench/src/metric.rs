//! The metrics that tables and plots compare, read from a level.

use crate::report::Level;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    OutputTokS,
    TtftP50,
    TtftP99,
    TpotP50,
}

impl Metric {
    pub const TABLES: [Metric; 4] = [
        Metric::OutputTokS,
        Metric::TtftP50,
        Metric::TtftP99,
        Metric::TpotP50,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Metric::OutputTokS => "Output tok/s (aggregate)",
            Metric::TtftP50 => "TTFT p50 (ms)",
            Metric::TtftP99 => "TTFT p99 (ms)",
            Metric::TpotP50 => "TPOT p50 (ms per output token)",
        }
    }

    pub fn higher_is_better(self) -> bool {
        self == Metric::OutputTokS
    }

    /// `None` when the level had no successful request.
    pub fn of(self, level: &Level) -> Option<f64> {
        match self {
            Metric::OutputTokS => (level.completed > 0).then_some(level.output_tok_s),
            Metric::TtftP50 => level.ttft_ms.map(|s| s.p50),
            Metric::TtftP99 => level.ttft_ms.map(|s| s.p99),
            Metric::TpotP50 => level.tpot_ms.map(|s| s.p50),
        }
    }

    /// The better of two values.
    pub fn best(self, a: f64, b: f64) -> f64 {
        if self.higher_is_better() {
            a.max(b)
        } else {
            a.min(b)
        }
    }
}
