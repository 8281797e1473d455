//! A global limit on generation requests in flight, with a bounded queue in
//! front of it: past `max_concurrent` requests wait, past `max_queued`
//! waiting ones the answer is 429 with `Retry-After`. A streamed response
//! holds its slot until its body ends (or the client leaves).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::protocol::ApiError;

pub struct Limiter {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_waiting: usize,
}

impl Limiter {
    pub fn new(max_concurrent: usize, max_waiting: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            waiting: AtomicUsize::new(0),
            max_waiting,
        }
    }

    /// A slot now, after waiting in the queue, or `QueueFull`.
    pub async fn acquire(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let _place = self.join_queue().ok_or(ApiError::QueueFull)?;
        self.slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Internal("the request limiter is closed".into()))
    }

    fn join_queue(&self) -> Option<QueuePlace<'_>> {
        let mut current = self.waiting.load(Ordering::Acquire);
        loop {
            if current >= self.max_waiting {
                return None;
            }
            match self.waiting.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(QueuePlace(&self.waiting)),
                Err(actual) => current = actual,
            }
        }
    }
}

/// Leaves the queue when dropped, including when the client gives up.
struct QueuePlace<'a>(&'a AtomicUsize);

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

pub async fn limit(State(limiter): State<Arc<Limiter>>, req: Request, next: Next) -> Response {
    let permit = match limiter.acquire().await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    next.run(req).await.map(|body| {
        Body::new(Holding {
            body,
            _permit: permit,
        })
    })
}

/// A response body that keeps the request's slot until it is done.
struct Holding {
    body: Body,
    _permit: OwnedSemaphorePermit,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_is_bounded() {
        let limiter = Arc::new(Limiter::new(1, 1));
        let first = limiter.acquire().await.unwrap();
        // One may wait...
        let waiter = {
            let l = limiter.clone();
            tokio::spawn(async move { l.acquire().await.map(drop) })
        };
        while limiter.waiting.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        // ...the next is turned away.
        assert_eq!(limiter.acquire().await.unwrap_err(), ApiError::QueueFull);
        drop(first);
        waiter.await.unwrap().unwrap();
        assert_eq!(limiter.waiting.load(Ordering::Acquire), 0);
        assert!(limiter.acquire().await.is_ok());
    }
}
