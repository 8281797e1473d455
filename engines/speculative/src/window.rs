//! Moving-window measures of one engine's rounds, the routing signals
//! `engine_accept_rate.NAME` (accepted / drafted) and
//! `engine_speedup.NAME` (what speculation is buying: tokens per target
//! forward times the cost of a plain decode step, over the rounds' cost).
//!
//! Rounds older than the window's age limit are forgotten, so an engine the
//! policy stopped using for a low rate becomes *unknown* again after a quiet
//! spell instead of staying condemned by yesterday's traffic. The rate stays
//! unknown until the window holds enough drafted tokens to judge by: one
//! rejected probe (a short request's only draft) would otherwise stop the
//! policy routing there until the window forgets it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::decode::RoundStats;

#[derive(Debug, Clone, Copy)]
struct Round {
    at: Instant,
    drafted: u32,
    accepted: u32,
    /// Seconds the round took, and what a plain decode step would have.
    seconds: f64,
    decode_seconds: f64,
}

#[derive(Debug)]
pub struct AcceptWindow {
    rounds: VecDeque<Round>,
    max_rounds: usize,
    max_age: Duration,
    /// Drafted tokens the window must hold before it reports a rate.
    min_drafted: u64,
}

impl AcceptWindow {
    pub fn new(max_rounds: usize, max_age: Duration, min_drafted: u64) -> Self {
        Self {
            rounds: VecDeque::with_capacity(max_rounds),
            max_rounds: max_rounds.max(1),
            max_age,
            min_drafted: min_drafted.max(1),
        }
    }

    /// A round that took `took`, where a decode step takes `decode_seconds`.
    pub fn record(&mut self, round: RoundStats, took: Duration, decode_seconds: f64) {
        self.record_at(Instant::now(), round, took, decode_seconds);
    }

    fn record_at(&mut self, at: Instant, round: RoundStats, took: Duration, decode_seconds: f64) {
        if self.rounds.len() == self.max_rounds {
            self.rounds.pop_front();
        }
        self.rounds.push_back(Round {
            at,
            drafted: round.drafted,
            accepted: round.accepted,
            seconds: took.as_secs_f64(),
            decode_seconds,
        });
    }

    /// Accepted / drafted over the recent rounds; `None` while they drafted
    /// fewer than the window's `min_drafted` tokens.
    pub fn rate(&mut self) -> Option<f32> {
        self.rate_at(Instant::now())
    }

    /// Tokens committed per unit of decode-step cost over the recent
    /// rounds: 1.0 is plain decoding's speed, above it speculation pays.
    /// `None` when there are no rounds.
    pub fn speedup(&mut self) -> Option<f32> {
        self.speedup_at(Instant::now())
    }

    fn expire(&mut self, now: Instant) {
        while self
            .rounds
            .front()
            .is_some_and(|r| now.duration_since(r.at) > self.max_age)
        {
            self.rounds.pop_front();
        }
    }

    fn rate_at(&mut self, now: Instant) -> Option<f32> {
        self.expire(now);
        let (drafted, accepted) = self.rounds.iter().fold((0u64, 0u64), |(d, a), r| {
            (d + r.drafted as u64, a + r.accepted as u64)
        });
        (drafted >= self.min_drafted).then(|| accepted as f32 / drafted as f32)
    }

    fn speedup_at(&mut self, now: Instant) -> Option<f32> {
        self.expire(now);
        let (worth, spent) = self.rounds.iter().fold((0.0, 0.0), |(w, s), r| {
            (
                w + (r.accepted + 1) as f64 * r.decode_seconds,
                s + r.seconds,
            )
        });
        (spent > 0.0).then(|| (worth / spent) as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(drafted: u32, accepted: u32) -> RoundStats {
        RoundStats { drafted, accepted }
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn rate_over_the_last_rounds_only() {
        let mut w = AcceptWindow::new(2, Duration::from_secs(60), 1);
        assert_eq!(w.rate(), None);
        w.record(round(4, 4), MS, 0.001);
        w.record(round(4, 0), MS, 0.001);
        assert_eq!(w.rate(), Some(0.5));
        w.record(round(4, 0), MS, 0.001);
        assert_eq!(w.rate(), Some(0.0), "the first round fell out");
        w.record(round(0, 0), MS, 0.001);
        assert_eq!(w.rate(), Some(0.0), "rounds without drafts add nothing");
    }

    #[test]
    fn a_rate_waits_for_enough_drafted_tokens() {
        let mut w = AcceptWindow::new(256, Duration::from_secs(60), 16);
        // A short request's one rejected probe says nothing yet.
        w.record(round(1, 0), MS, 0.001);
        assert_eq!(w.rate(), None);
        for _ in 0..7 {
            w.record(round(2, 2), MS, 0.001);
        }
        assert_eq!(w.rate(), None, "15 drafted tokens");
        w.record(round(1, 1), MS, 0.001);
        assert_eq!(w.rate(), Some(15.0 / 16.0));
    }

    #[test]
    fn speedup_weighs_tokens_by_what_the_rounds_cost() {
        let mut w = AcceptWindow::new(8, Duration::from_secs(60), 1);
        assert_eq!(w.speedup(), None);
        // Plain decode steps: exactly plain speed.
        w.record(round(0, 0), 10 * MS, 0.010);
        assert!((w.speedup().unwrap() - 1.0).abs() < 1e-6);
        // A round of 4 drafts, 3 accepted, at twice a decode step's cost:
        // 1 + 4 tokens for 3 steps' time.
        w.record(round(4, 3), 20 * MS, 0.010);
        assert!((w.speedup().unwrap() - 5.0 / 3.0).abs() < 1e-5);
    }

    #[test]
    fn old_rounds_expire() {
        let mut w = AcceptWindow::new(16, Duration::from_secs(10), 1);
        let t0 = Instant::now();
        w.record_at(t0, round(8, 1), MS, 0.001);
        assert_eq!(w.rate_at(t0 + Duration::from_secs(5)), Some(0.125));
        assert_eq!(w.rate_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(w.speedup_at(t0 + Duration::from_secs(11)), None);
    }
}
