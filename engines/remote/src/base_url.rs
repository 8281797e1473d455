//! An upstream's base URL and the endpoint URIs under it.

use hyper::Uri;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    /// `http://host:port` plus any path prefix, without a trailing `/` or
    /// `/v1`.
    base: String,
}

impl BaseUrl {
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("upstream url `{url}`: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            // No TLS client here on purpose: put a TLS-terminating proxy in
            // front of a remote upstream instead.
            Some("https") => {
                return Err(format!(
                    "upstream url `{url}`: https is not supported; reach the upstream over http (or a local TLS-terminating proxy)"
                ))
            }
            _ => return Err(format!("upstream url `{url}` must start with http://")),
        }
        if uri.authority().is_none() {
            return Err(format!("upstream url `{url}` has no host"));
        }
        let trimmed = url.trim_end_matches('/');
        let base = trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_owned();
        Ok(BaseUrl { base })
    }

    /// `path` starts with `/`.
    pub fn endpoint(&self, path: &str) -> Uri {
        format!("{}{path}", self.base)
            .parse()
            .expect("a valid base URL plus an absolute path is a valid URI")
    }

    pub fn as_str(&self) -> &str {
        &self.base
    }
}

impl std::fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_under_the_base() {
        for url in [
            "http://127.0.0.1:8001",
            "http://127.0.0.1:8001/",
            "http://127.0.0.1:8001/v1",
            "http://127.0.0.1:8001/v1/",
        ] {
            let b = BaseUrl::parse(url).unwrap();
            assert_eq!(
                b.endpoint("/v1/completions").to_string(),
                "http://127.0.0.1:8001/v1/completions"
            );
        }
        let prefixed = BaseUrl::parse("http://h/llm").unwrap();
        assert_eq!(
            prefixed.endpoint("/metrics").to_string(),
            "http://h/llm/metrics"
        );
    }

    #[test]
    fn refuses_other_schemes() {
        assert!(BaseUrl::parse("https://h").unwrap_err().contains("https"));
        assert!(BaseUrl::parse("ftp://h").is_err());
        assert!(BaseUrl::parse("h:80").is_err());
        assert!(BaseUrl::parse("not a url").is_err());
    }
}
