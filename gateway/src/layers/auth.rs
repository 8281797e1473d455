//! Optional API keys. When any key is configured, API routes need one as
//! `Authorization: Bearer <key>` (or `x-api-key`). Keys are compared in
//! constant time and every key is checked, so timing does not tell how
//! much of a guess matched or which key it was.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::body::CacheScope;
use crate::protocol::ApiError;

#[derive(Debug, Default)]
pub struct ApiKeys {
    keys: Vec<Vec<u8>>,
}

impl ApiKeys {
    pub fn new(keys: Vec<String>) -> Self {
        Self {
            keys: keys.into_iter().map(String::into_bytes).collect(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Index of the matching key.
    pub fn find(&self, presented: &[u8]) -> Option<usize> {
        let mut found = None;
        for (i, key) in self.keys.iter().enumerate() {
            if constant_time_eq(key, presented) && found.is_none() {
                found = Some(i);
            }
        }
        found
    }
}

/// Equal-length inputs take the same time whatever their contents.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn presented(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let v = v.as_bytes();
        let scheme = b"bearer ";
        if v.len() > scheme.len() && v[..scheme.len()].eq_ignore_ascii_case(scheme) {
            return Some(v[scheme.len()..].trim_ascii());
        }
        return None;
    }
    headers.get("x-api-key").map(|v| v.as_bytes().trim_ascii())
}

pub async fn require(State(keys): State<Arc<ApiKeys>>, mut req: Request, next: Next) -> Response {
    if !keys.is_enabled() {
        return next.run(req).await;
    }
    match presented(req.headers()).and_then(|p| keys.find(p)) {
        Some(index) => {
            req.extensions_mut()
                .insert(CacheScope(format!("key-{index}")));
            next.run(req).await
        }
        None => ApiError::Unauthorized.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn finds_keys_exactly() {
        let keys = ApiKeys::new(vec!["alpha".into(), "beta-key".into()]);
        assert_eq!(keys.find(b"alpha"), Some(0));
        assert_eq!(keys.find(b"beta-key"), Some(1));
        assert_eq!(keys.find(b"alph"), None);
        assert_eq!(keys.find(b"alphb"), None);
        assert_eq!(keys.find(b""), None);
        assert!(!ApiKeys::default().is_enabled());
    }

    #[test]
    fn reads_bearer_and_x_api_key() {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer  sk-1 "),
        );
        assert_eq!(presented(&h), Some(&b"sk-1"[..]));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(presented(&h), None);
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("sk-2"));
        assert_eq!(presented(&h), Some(&b"sk-2"[..]));
    }
}
