//! The upstreams behind one engine name: their health, their published
//! load, our in-flight requests to each, and the pick for a request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::balance::{self, BalanceRules, Candidate, Choice};
use crate::base_url::BaseUrl;
use crate::config::{Protocol, UpstreamConfig};
use crate::load_report::LoadReport;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Not checked yet: gets no work.
    Unknown,
    Healthy,
    Unhealthy(String),
}

#[derive(Debug)]
struct UpstreamState {
    health: Health,
    /// The model id to send, learned from its `/v1/models`.
    served_model: Option<String>,
    report: LoadReport,
}

#[derive(Debug)]
pub struct Upstream {
    pub index: usize,
    pub url: BaseUrl,
    pub protocol: Protocol,
    /// The model id configured for this upstream, if any.
    pub model: Option<String>,
    key: u64,
    outstanding: AtomicUsize,
    state: Mutex<UpstreamState>,
}

impl Upstream {
    pub fn new(index: usize, config: &UpstreamConfig) -> Result<Self, String> {
        let url = BaseUrl::parse(&config.url)?;
        Ok(Upstream {
            index,
            key: balance::fnv(url.as_str().bytes()),
            url,
            protocol: config.protocol,
            model: config.model.clone(),
            outstanding: AtomicUsize::new(0),
            state: Mutex::new(UpstreamState {
                health: Health::Unknown,
                served_model: None,
                report: LoadReport::default(),
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, UpstreamState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn health(&self) -> Health {
        self.state().health.clone()
    }

    pub fn is_healthy(&self) -> bool {
        self.state().health == Health::Healthy
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Acquire)
    }

    pub fn served_model(&self) -> Option<String> {
        self.state().served_model.clone()
    }

    pub fn report(&self) -> LoadReport {
        self.state().report
    }

    /// Records a health check's verdict; returns the previous one so the
    /// caller logs changes only.
    pub fn set_health(&self, health: Health, served_model: Option<String>) -> Health {
        let mut s = self.state();
        if served_model.is_some() {
            s.served_model = served_model;
        }
        std::mem::replace(&mut s.health, health)
    }

    /// A request could not reach it: no more work until a check passes.
    pub fn mark_down(&self, reason: String) -> Health {
        self.set_health(Health::Unhealthy(reason), None)
    }

    pub fn set_report(&self, report: LoadReport) {
        self.state().report = report;
    }
}

/// One request in flight on an upstream; counted until dropped.
pub struct Lease {
    pub upstream: Arc<Upstream>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.upstream.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

pub struct Pool {
    pub upstreams: Vec<Arc<Upstream>>,
    rules: BalanceRules,
    affinity_prefix_tokens: usize,
    /// Picks happen one at a time, so two requests arriving together see
    /// each other's lease.
    pick_lock: Mutex<usize>,
}

pub enum Pick {
    Leased(Lease),
    AllBusy,
    NoneHealthy,
}

impl Pool {
    pub fn new(
        upstreams: Vec<Arc<Upstream>>,
        rules: BalanceRules,
        affinity_prefix_tokens: usize,
    ) -> Self {
        Pool {
            upstreams,
            rules,
            affinity_prefix_tokens,
            pick_lock: Mutex::new(0),
        }
    }

    /// The upstream for this prompt, skipping those already tried.
    pub fn pick(&self, prompt: &[u32], tried: &[usize]) -> Pick {
        let affinity = balance::prefix_key(prompt, self.affinity_prefix_tokens);
        let mut rotation = self.pick_lock.lock().unwrap_or_else(|e| e.into_inner());
        let candidates: Vec<Candidate> = self
            .upstreams
            .iter()
            .map(|u| Candidate {
                key: u.key,
                healthy: u.is_healthy(),
                outstanding: u.outstanding(),
                report: u.report(),
            })
            .collect();
        match balance::choose(&candidates, tried, affinity, &self.rules, *rotation) {
            Choice::Upstream(i) => {
                *rotation = rotation.wrapping_add(1);
                let upstream = self.upstreams[i].clone();
                upstream.outstanding.fetch_add(1, Ordering::AcqRel);
                Pick::Leased(Lease { upstream })
            }
            Choice::AllBusy => Pick::AllBusy,
            Choice::NoneHealthy => Pick::NoneHealthy,
        }
    }

    pub fn healthy_count(&self) -> usize {
        self.upstreams.iter().filter(|u| u.is_healthy()).count()
    }

    pub fn outstanding(&self) -> usize {
        self.upstreams.iter().map(|u| u.outstanding()).sum()
    }

    /// What the upstreams report waiting in their own queues.
    pub fn reported_waiting(&self) -> usize {
        self.upstreams
            .iter()
            .filter(|u| u.is_healthy())
            .map(|u| u.report().waiting.unwrap_or(0.0) as usize)
            .sum()
    }
}

impl Pool {
    /// Every healthy upstream is at its in-flight cap.
    pub fn all_at_cap(&self) -> bool {
        let Some(cap) = self.rules.max_outstanding else {
            return false;
        };
        self.upstreams
            .iter()
            .filter(|u| u.is_healthy())
            .all(|u| u.outstanding() >= cap)
    }
}
