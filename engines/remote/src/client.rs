//! The HTTP/1.1 client every upstream request goes through: one pooled
//! hyper client per engine, so connections to an upstream are reused.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Small bodies (errors, `/v1/models`, `/metrics`) are read whole up to
/// this size.
const SMALL_BODY_LIMIT: usize = 4 << 20;

/// A request that got no response.
#[derive(Debug)]
pub struct SendError {
    pub message: String,
    /// No connection could be made: the upstream is down, not just this
    /// exchange.
    pub connect: bool,
}

#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl HttpClient {
    pub fn new(connect_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        HttpClient { inner }
    }

    pub async fn post_json(
        &self,
        uri: Uri,
        body: &serde_json::Value,
    ) -> Result<Response<Incoming>, SendError> {
        let request = Request::post(uri)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::ACCEPT, "text/event-stream")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| SendError {
                message: e.to_string(),
                connect: false,
            })?;
        self.inner.request(request).await.map_err(|e| SendError {
            connect: e.is_connect(),
            message: describe(e),
        })
    }

    /// A GET read whole, within `timeout`.
    pub async fn get_text(
        &self,
        uri: Uri,
        timeout: Duration,
    ) -> Result<(StatusCode, String), String> {
        let request = Request::get(uri)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let response = self.inner.request(request).await.map_err(describe)?;
            let status = response.status();
            let text = read_small(response.into_body()).await?;
            Ok((status, text))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| format!("no answer within {} ms", timeout.as_millis()))?
    }
}

/// A short body (an error message) as text.
pub async fn read_small(body: Incoming) -> Result<String, String> {
    let bytes = Limited::new(body, SMALL_BODY_LIMIT)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// hyper-util's error text is terse ("client error (Connect)"); its source
/// says what happened.
fn describe(e: hyper_util::client::legacy::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
