//! Plain-HTTP client for one server: streamed POSTs timed chunk by chunk,
//! and a GET for discovery.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::record::{RequestRecord, StreamTracker};
use sse::SseDecoder;

#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    /// `http://host:port` with any path prefix, no trailing slash.
    base: String,
    timeout: Duration,
}

impl HttpClient {
    pub fn new(base: &str, timeout: Duration) -> Result<Self> {
        let base = base.trim_end_matches('/').to_owned();
        let uri: Uri = base.parse().with_context(|| format!("bad URL {base}"))?;
        if uri.scheme_str() != Some("http") {
            bail!("only plain http:// URLs are supported, got {base}");
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new()).build(connector);
        Ok(HttpClient {
            inner,
            base,
            timeout,
        })
    }

    fn uri(&self, path: &str) -> Result<Uri> {
        let full = format!("{}{path}", self.base);
        full.parse().with_context(|| format!("bad URL {full}"))
    }

    /// GETs a JSON document.
    pub async fn get_json(&self, path: &str) -> Result<Value> {
        let req = Request::get(self.uri(path)?).body(Full::new(Bytes::new()))?;
        let resp = tokio::time::timeout(self.timeout, self.inner.request(req))
            .await
            .context("timed out")??;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("GET {path}: {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(serde_json::from_slice(&body)?)
    }

    /// POSTs `body` and reads its event stream to the end, timing every
    /// chunk. Never fails: what went wrong is in the record.
    pub async fn stream(&self, path: &str, body: &Value) -> RequestRecord {
        let start = Instant::now();
        let request = match self.uri(path).and_then(|uri| {
            Ok(Request::post(uri)
                .header("content-type", "application/json")
                .header("accept", "text/event-stream")
                .body(Full::new(Bytes::from(body.to_string())))?)
        }) {
            Ok(r) => r,
            Err(_) => return RequestRecord::failed("bad_request", start.elapsed(), None),
        };
        match tokio::time::timeout(self.timeout, self.exchange(request, start)).await {
            Ok(record) => record,
            Err(_) => RequestRecord::failed("timeout", start.elapsed(), None),
        }
    }

    async fn exchange(&self, request: Request<Full<Bytes>>, start: Instant) -> RequestRecord {
        let response: Response<Incoming> = match self.inner.request(request).await {
            Ok(r) => r,
            Err(_) => return RequestRecord::failed("connect", start.elapsed(), None),
        };
        let engine = response
            .headers()
            .get("x-engine")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            // Read the error body so the connection can be reused.
            let _ = body.collect().await;
            return RequestRecord::failed(
                format!("http_{}", status.as_u16()),
                start.elapsed(),
                engine,
            );
        }
        let mut parser = SseDecoder::new();
        let mut tracker = StreamTracker::new(start);
        let mut broken = false;
        while let Some(frame) = body.frame().await {
            let now = Instant::now();
            match frame {
                Ok(frame) => {
                    if let Some(data) = frame.data_ref() {
                        for event in parser.push(data) {
                            tracker.on_event(event, now);
                        }
                    }
                }
                Err(_) => {
                    broken = true;
                    break;
                }
            }
        }
        tracker.finish(Instant::now(), broken, engine)
    }
}
