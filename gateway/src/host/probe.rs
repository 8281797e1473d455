//! Bringing benched engines back. An engine taken out of routing by a
//! fault that does not expire (a panic, a stream lost mid-request) is
//! sent a one-token request every interval; when it answers, it routes
//! again. An engine whose worker died stays out until it serves.

use std::sync::Arc;
use std::time::Duration;

use super::Registry;

/// How long a probe request may take before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Probes benched engines every `interval` for as long as the server runs.
pub fn spawn(registry: Arc<Registry>, interval: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            for entry in registry.engines() {
                if entry.needs_probe() {
                    entry.probe(PROBE_TIMEOUT).await;
                }
            }
        }
    });
}
