//! The engine's own section of config.yaml.

use std::time::Duration;

use serde::Deserialize;

/// How token ids cross the wire to an upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// `/v1/completions` with the prompt as token ids and
    /// `return_token_ids: true` (this gateway, vLLM): exact ids both ways.
    #[default]
    TokenIds,
    /// Text both ways, for servers that only speak text (`mlx_lm.server`):
    /// the prompt is decoded with the shared tokenizer and each streamed
    /// text piece is re-tokenized.
    Text,
}

/// One upstream: a bare URL, or a mapping with options.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum UpstreamEntry {
    Url(String),
    Full(UpstreamConfig),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL, such as `http://10.0.0.2:8000` (a trailing `/v1` is fine).
    pub url: String,
    #[serde(default)]
    pub protocol: Protocol,
    /// The model id to ask this upstream for. Default: the id it lists
    /// that names this gateway's model (equal, or its last path part).
    pub model: Option<String>,
}

impl UpstreamEntry {
    pub fn into_config(self) -> UpstreamConfig {
        match self {
            UpstreamEntry::Url(url) => UpstreamConfig {
                url,
                protocol: Protocol::default(),
                model: None,
            },
            UpstreamEntry::Full(c) => c,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// Plugin kind; read by the host.
    pub kind: Option<String>,
    pub upstreams: Vec<UpstreamEntry>,
    pub connect_timeout_ms: u64,
    /// From sending the request until the upstream's first token.
    pub first_token_timeout_ms: u64,
    /// Longest silence between two chunks once tokens flow.
    pub idle_timeout_ms: u64,
    pub health_interval_ms: u64,
    pub health_timeout_ms: u64,
    /// Further upstreams tried when one fails before its first token.
    pub retries: usize,
    /// Requests whose prompt has at least this many tokens go, by a hash of
    /// their first this-many tokens, to the same upstream (0 disables).
    pub affinity_prefix_tokens: usize,
    /// Affinity gives way when its upstream has this many more requests in
    /// flight than the least loaded one.
    pub affinity_max_imbalance: usize,
    /// Requests in flight per upstream at most; beyond, the engine refuses
    /// (so the router can fall back). `None`: unbounded.
    pub max_outstanding_per_upstream: Option<usize>,
    /// Upstreams publishing a KV usage above this get work only when every
    /// upstream does.
    pub kv_high_watermark: f64,
    /// Where upstreams publish Prometheus load figures (`null`: never ask).
    pub metrics_path: Option<String>,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            kind: None,
            upstreams: Vec::new(),
            connect_timeout_ms: 2_000,
            first_token_timeout_ms: 120_000,
            idle_timeout_ms: 60_000,
            health_interval_ms: 2_000,
            health_timeout_ms: 2_000,
            retries: 2,
            affinity_prefix_tokens: 256,
            affinity_max_imbalance: 4,
            max_outstanding_per_upstream: None,
            kv_high_watermark: 0.9,
            metrics_path: Some("/metrics".into()),
        }
    }
}

impl RemoteConfig {
    pub fn from_yaml(section: &serde_yaml::Value) -> Result<Self, String> {
        let cfg: Self = serde_yaml::from_value(section.clone())
            .map_err(|e| format!("remote engine config: {e}"))?;
        if cfg.upstreams.is_empty() {
            return Err("remote engine config: `upstreams` names no upstream".into());
        }
        if cfg.health_interval_ms == 0 {
            return Err("remote engine config: health_interval_ms must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&cfg.kv_high_watermark) {
            return Err("remote engine config: kv_high_watermark must be in 0..=1".into());
        }
        Ok(cfg)
    }

    pub fn upstream_configs(&self) -> Vec<UpstreamConfig> {
        self.upstreams
            .iter()
            .cloned()
            .map(UpstreamEntry::into_config)
            .collect()
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn first_token_timeout(&self) -> Duration {
        Duration::from_millis(self.first_token_timeout_ms)
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }
    pub fn health_timeout(&self) -> Duration {
        Duration::from_millis(self.health_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<RemoteConfig, String> {
        RemoteConfig::from_yaml(&serde_yaml::from_str(yaml).unwrap())
    }

    #[test]
    fn bare_urls_and_mappings() {
        let c = parse(
            "kind: remote\nupstreams: [\"http://a:1\", { url: \"http://b:2\", protocol: text, model: m }]\naffinity_prefix_tokens: 0",
        )
        .unwrap();
        let ups = c.upstream_configs();
        assert_eq!(ups[0].url, "http://a:1");
        assert_eq!(ups[0].protocol, Protocol::TokenIds);
        assert_eq!(ups[1].protocol, Protocol::Text);
        assert_eq!(ups[1].model.as_deref(), Some("m"));
        assert_eq!(c.affinity_prefix_tokens, 0);
        assert_eq!(c.retries, 2);
    }

    #[test]
    fn rejects_bad_sections() {
        assert!(parse("kind: remote").unwrap_err().contains("upstreams"));
        assert!(parse("upstreams: [\"http://a\"]\nbogus: 1")
            .unwrap_err()
            .contains("bogus"));
        assert!(parse("upstreams: [\"http://a\"]\nkv_high_watermark: 2").is_err());
        assert!(parse("upstreams: [{ url: \"http://a\", protocol: grpc }]").is_err());
    }
}
