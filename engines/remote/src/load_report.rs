//! The load figures an upstream publishes in Prometheus text, for the
//! servers we know: vLLM, SGLang and this gateway. Anything else reports
//! nothing and is balanced on our own in-flight counts alone.

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadReport {
    /// Requests the upstream is generating for (all its clients).
    pub running: Option<f64>,
    /// Requests waiting in the upstream's queue.
    pub waiting: Option<f64>,
    /// KV cache usage in 0..=1.
    pub kv_usage: Option<f64>,
}

const RUNNING: &[&str] = &[
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "gateway_engine_active",
];
const WAITING: &[&str] = &[
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "gateway_engine_queued",
];
const KV_USAGE: &[&str] = &[
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "gateway_kv_pressure",
];

impl LoadReport {
    /// Counts are summed over label sets (engines, models); KV usage takes
    /// the highest.
    pub fn parse(text: &str) -> LoadReport {
        let mut r = LoadReport::default();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((series, value)) = sample(line) else {
                continue;
            };
            let name = series.split('{').next().unwrap_or(series);
            if RUNNING.contains(&name) {
                *r.running.get_or_insert(0.0) += value;
            } else if WAITING.contains(&name) {
                *r.waiting.get_or_insert(0.0) += value;
            } else if KV_USAGE.contains(&name) {
                let kv = r.kv_usage.get_or_insert(0.0);
                *kv = kv.max(value);
            }
        }
        r
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_none() && self.waiting.is_none() && self.kv_usage.is_none()
    }
}

/// `name{labels} value [timestamp]` into the series and a finite value.
fn sample(line: &str) -> Option<(&str, f64)> {
    let series_end = match line.find('}') {
        Some(i) => i + 1,
        None => line.find(char::is_whitespace)?,
    };
    let (series, rest) = line.split_at(series_end);
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((series, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm() {
        let r = LoadReport::parse(
            "# HELP vllm:num_requests_running Number of requests.\n\
             vllm:num_requests_running{model_name=\"m\"} 3.0\n\
             vllm:num_requests_waiting{model_name=\"m\"} 2.0\n\
             vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.75\n\
             vllm:other 9\n",
        );
        assert_eq!(
            r,
            LoadReport {
                running: Some(3.0),
                waiting: Some(2.0),
                kv_usage: Some(0.75)
            }
        );
    }

    #[test]
    fn gateway_sums_engines() {
        let r = LoadReport::parse(
            "gateway_engine_active{engine=\"batched\"} 2\n\
             gateway_engine_active{engine=\"fastpath\"} 1\n\
             gateway_engine_queued{engine=\"batched\"} 4\n\
             gateway_kv_pressure 0.5\n",
        );
        assert_eq!(r.running, Some(3.0));
        assert_eq!(r.waiting, Some(4.0));
        assert_eq!(r.kv_usage, Some(0.5));
    }

    #[test]
    fn sglang_labels_with_spaces_and_unknown_servers() {
        let r = LoadReport::parse("sglang:token_usage{name=\"a b\"} 0.2 1700000000\n");
        assert_eq!(r.kv_usage, Some(0.2));
        assert!(LoadReport::parse("Not Found").is_empty());
        assert!(LoadReport::parse("foo 1\nbar{x=\"1\"} NaN\n").is_empty());
    }
}
