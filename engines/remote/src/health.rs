//! Periodic health checks: an upstream is healthy when its `/v1/models`
//! lists this gateway's model (or, for servers whose model list cannot be
//! read, when `/health` answers 200). Its published load figures are read
//! on the same tick. Changes are logged; an unhealthy upstream gets no work
//! until a check passes again.

use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;
use serde_json::Value;

use crate::client::HttpClient;
use crate::load_report::LoadReport;
use crate::pool::{Health, Upstream};

pub struct Checker {
    pub client: HttpClient,
    /// The model this gateway serves; every upstream must serve it too.
    pub model: String,
    pub timeout: Duration,
    pub metrics_path: Option<String>,
}

impl Checker {
    pub async fn check(&self, upstream: &Upstream) {
        let (health, served) = self.probe(upstream).await;
        if health == Health::Healthy {
            if let Some(path) = &self.metrics_path {
                upstream.set_report(self.load_report(upstream, path).await);
            }
        }
        let previous = upstream.set_health(health.clone(), served);
        log_change(upstream, &previous, &health);
    }

    /// Checks every upstream every `interval`, forever.
    pub async fn run(self: Arc<Self>, upstreams: Vec<Arc<Upstream>>, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let checks = upstreams.iter().map(|u| {
                let checker = self.clone();
                let u = u.clone();
                tokio::spawn(async move { checker.check(&u).await })
            });
            for c in checks.collect::<Vec<_>>() {
                let _ = c.await;
            }
        }
    }

    async fn probe(&self, upstream: &Upstream) -> (Health, Option<String>) {
        let models = self
            .client
            .get_text(upstream.url.endpoint("/v1/models"), self.timeout)
            .await;
        match models {
            Ok((StatusCode::OK, body)) => match listed_ids(&body) {
                Some(ids) => match self.matching_id(upstream, &ids) {
                    Some(id) => (Health::Healthy, Some(id)),
                    None => (
                        Health::Unhealthy(format!(
                            "it serves {ids:?}, not `{}`: every upstream must serve this gateway's model and tokenizer",
                            self.model
                        )),
                        None,
                    ),
                },
                None => self.health_endpoint(upstream).await,
            },
            Ok((status, _)) if status.is_server_error() || status == StatusCode::NOT_FOUND => {
                self.health_endpoint(upstream).await
            }
            Ok((status, _)) => (
                Health::Unhealthy(format!("GET /v1/models answered {status}")),
                None,
            ),
            Err(e) => (Health::Unhealthy(e), None),
        }
    }

    /// The fallback when the model list is unreadable: liveness only.
    async fn health_endpoint(&self, upstream: &Upstream) -> (Health, Option<String>) {
        match self
            .client
            .get_text(upstream.url.endpoint("/health"), self.timeout)
            .await
        {
            Ok((StatusCode::OK, _)) => (Health::Healthy, None),
            Ok((status, _)) => (
                Health::Unhealthy(format!("GET /health answered {status}")),
                None,
            ),
            Err(e) => (Health::Unhealthy(e), None),
        }
    }

    /// The listed id naming our model: the configured id, or one equal to
    /// our model's name or ending in `/<name>` (servers that list a path).
    fn matching_id(&self, upstream: &Upstream, ids: &[String]) -> Option<String> {
        if let Some(model) = &upstream.model {
            if ids.contains(model) {
                return Some(model.clone());
            }
        }
        ids.iter()
            .find(|id| {
                let id = id.trim_end_matches('/');
                id == self.model || id.rsplit('/').next() == Some(self.model.as_str())
            })
            .cloned()
    }

    async fn load_report(&self, upstream: &Upstream, path: &str) -> LoadReport {
        match self
            .client
            .get_text(upstream.url.endpoint(path), self.timeout)
            .await
        {
            Ok((StatusCode::OK, text)) => LoadReport::parse(&text),
            _ => LoadReport::default(),
        }
    }
}

fn listed_ids(body: &str) -> Option<Vec<String>> {
    let v: Value = serde_json::from_str(body).ok()?;
    let data = v.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_owned))
            .collect(),
    )
}

pub fn log_change(upstream: &Upstream, previous: &Health, now: &Health) {
    if previous == now {
        return;
    }
    match now {
        Health::Healthy => {
            tracing::info!(upstream = %upstream.url, model = ?upstream.served_model(), "upstream healthy")
        }
        Health::Unhealthy(reason) => {
            tracing::warn!(upstream = %upstream.url, %reason, "upstream unhealthy; it gets no work until it recovers")
        }
        Health::Unknown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_lists() {
        assert_eq!(
            listed_ids(r#"{"object":"list","data":[{"id":"a"},{"id":"/m/b"}]}"#),
            Some(vec!["a".to_owned(), "/m/b".to_owned()])
        );
        assert_eq!(listed_ids(""), None);
        assert_eq!(listed_ids("{}"), None);
    }

    #[test]
    fn ids_that_name_the_model() {
        let checker = Checker {
            client: HttpClient::new(Duration::from_secs(1)),
            model: "tiny-qwen3".into(),
            timeout: Duration::from_secs(1),
            metrics_path: None,
        };
        let plain = Upstream::new(
            0,
            &crate::config::UpstreamConfig {
                url: "http://h".into(),
                protocol: Default::default(),
                model: None,
            },
        )
        .unwrap();
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            checker.matching_id(&plain, &ids(&["x", "tiny-qwen3"])),
            Some("tiny-qwen3".into())
        );
        assert_eq!(
            checker.matching_id(&plain, &ids(&["/models/tiny-qwen3/"])),
            Some("/models/tiny-qwen3/".into())
        );
        assert_eq!(checker.matching_id(&plain, &ids(&["tiny-qwen3-b"])), None);
        let named = Upstream::new(
            0,
            &crate::config::UpstreamConfig {
                url: "http://h".into(),
                protocol: Default::default(),
                model: Some("alias".into()),
            },
        )
        .unwrap();
        assert_eq!(
            checker.matching_id(&named, &ids(&["alias"])),
            Some("alias".into())
        );
    }
}
