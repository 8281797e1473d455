//! Moving-window draft acceptance of one engine: the routing signal
//! `engine_accept_rate.NAME`.
//!
//! Rounds older than the window's age limit are forgotten, so an engine the
//! policy stopped using for a low rate becomes *unknown* again after a quiet
//! spell instead of staying condemned by yesterday's traffic.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct AcceptWindow {
    rounds: VecDeque<(Instant, u32, u32)>,
    max_rounds: usize,
    max_age: Duration,
}

impl AcceptWindow {
    pub fn new(max_rounds: usize, max_age: Duration) -> Self {
        Self {
            rounds: VecDeque::with_capacity(max_rounds),
            max_rounds: max_rounds.max(1),
            max_age,
        }
    }

    pub fn record(&mut self, drafted: u32, accepted: u32) {
        self.record_at(Instant::now(), drafted, accepted);
    }

    fn record_at(&mut self, at: Instant, drafted: u32, accepted: u32) {
        if drafted == 0 {
            return;
        }
        if self.rounds.len() == self.max_rounds {
            self.rounds.pop_front();
        }
        self.rounds.push_back((at, drafted, accepted));
    }

    /// Accepted / drafted over the recent rounds; `None` when there are none.
    pub fn rate(&mut self) -> Option<f32> {
        self.rate_at(Instant::now())
    }

    fn rate_at(&mut self, now: Instant) -> Option<f32> {
        while self
            .rounds
            .front()
            .is_some_and(|(at, ..)| now.duration_since(*at) > self.max_age)
        {
            self.rounds.pop_front();
        }
        let (drafted, accepted) = self
            .rounds
            .iter()
            .fold((0u64, 0u64), |(d, a), r| (d + r.1 as u64, a + r.2 as u64));
        (drafted > 0).then(|| accepted as f32 / drafted as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_over_the_last_rounds_only() {
        let mut w = AcceptWindow::new(2, Duration::from_secs(60));
        assert_eq!(w.rate(), None);
        w.record(4, 4);
        w.record(4, 0);
        assert_eq!(w.rate(), Some(0.5));
        w.record(4, 0);
        assert_eq!(w.rate(), Some(0.0), "the first round fell out");
        w.record(0, 0);
        assert_eq!(w.rate(), Some(0.0), "rounds without drafts do not count");
    }

    #[test]
    fn old_rounds_expire() {
        let mut w = AcceptWindow::new(16, Duration::from_secs(10));
        let t0 = Instant::now();
        w.record_at(t0, 8, 1);
        assert_eq!(w.rate_at(t0 + Duration::from_secs(5)), Some(0.125));
        assert_eq!(w.rate_at(t0 + Duration::from_secs(11)), None);
    }
}
