//! The concurrency sweep: at each level, c clients send requests back to
//! back until the level's amount is spent. Prompt indices run on across
//! levels, so no prompt is sent twice in a sweep.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::HttpClient;
use crate::prompts::PromptSet;
use crate::record::RequestRecord;
use crate::report::Level;
use crate::request::RequestShape;

/// How many requests a level sends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    /// Exactly this many at every level.
    Requests(usize),
    /// `rounds` per client, at least `min` in all.
    Rounds { rounds: usize, min: usize },
    /// Clients start requests until this much time has passed.
    Duration(Duration),
}

impl Amount {
    fn limit(self, concurrency: usize) -> Option<usize> {
        match self {
            Amount::Requests(n) => Some(n),
            Amount::Rounds { rounds, min } => Some((rounds * concurrency).max(min)),
            Amount::Duration(_) => None,
        }
    }

    pub fn describe(self) -> String {
        match self {
            Amount::Requests(n) => format!("requests {n}"),
            Amount::Rounds { rounds, min } => format!("rounds {rounds} (min {min})"),
            Amount::Duration(d) => format!("duration {} s", d.as_secs_f64()),
        }
    }
}

/// A client waits this long after a failed request before its next one.
pub const FAILURE_PAUSE: Duration = Duration::from_millis(100);

/// Where warm-up prompts start: far from the measured ones.
const WARMUP_BASE: usize = 1 << 40;

pub struct Sweep {
    pub client: HttpClient,
    pub shape: RequestShape,
    pub prompts: Arc<PromptSet>,
    pub amount: Amount,
}

impl Sweep {
    /// Unmeasured requests at each of these concurrencies, with short
    /// outputs: first-use costs (kernel compilation, allocation) out of
    /// the way. Returns the failures.
    pub async fn warm_up(&self, levels: &[usize]) -> Vec<String> {
        let mut failures = Vec::new();
        let mut next = WARMUP_BASE;
        for &c in levels {
            let mut tasks = Vec::new();
            for _ in 0..c {
                let body =
                    self.shape
                        .body(next, &self.prompts.get(next), self.shape.max_tokens.min(8));
                next += 1;
                let (client, path) = (self.client.clone(), self.shape.endpoint.path());
                tasks.push(tokio::spawn(
                    async move { client.stream(path, &body).await },
                ));
            }
            for task in tasks {
                if let Ok(RequestRecord {
                    error: Some(kind), ..
                }) = task.await
                {
                    failures.push(kind);
                }
            }
        }
        failures
    }

    /// Runs one level; `next_prompt` is shared by the whole sweep.
    pub async fn level(&self, concurrency: usize, next_prompt: &Arc<AtomicUsize>) -> Level {
        let sent = Arc::new(AtomicUsize::new(0));
        let limit = self.amount.limit(concurrency);
        let deadline = match self.amount {
            Amount::Duration(d) => Some(Instant::now() + d),
            _ => None,
        };
        let started = Instant::now();
        let mut clients = Vec::new();
        for _ in 0..concurrency {
            let (client, shape, prompts) = (
                self.client.clone(),
                self.shape.clone(),
                self.prompts.clone(),
            );
            let (sent, next_prompt) = (sent.clone(), next_prompt.clone());
            clients.push(tokio::spawn(async move {
                let mut records = Vec::new();
                loop {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        break;
                    }
                    if limit.is_some_and(|n| sent.fetch_add(1, Ordering::SeqCst) >= n) {
                        break;
                    }
                    let index = next_prompt.fetch_add(1, Ordering::SeqCst);
                    let body = shape.body(index, &prompts.get(index), shape.max_tokens);
                    let record = client.stream(shape.endpoint.path(), &body).await;
                    let failed = record.error.is_some();
                    records.push(record);
                    if failed {
                        // A refused request returns at once: no busy loop.
                        tokio::time::sleep(FAILURE_PAUSE).await;
                    }
                }
                records
            }));
        }
        let mut records = Vec::new();
        for client in clients {
            records.extend(client.await.unwrap_or_default());
        }
        Level::from_records(concurrency, &records, started.elapsed().as_secs_f64())
    }
}
