//! A request body that reports how its upload ended.
//!
//! The gateway may let the next request on a key through only when the
//! current one can no longer change the storage. A response head proves the
//! storage decided; it does not prove the request body stopped flowing (a
//! storage may answer before reading the whole upload). So the forward of a
//! fenced request also waits for its body to end — sent in full, failed, or
//! dropped by the client library — before giving up the key.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;

use super::{BoxError, ProxyBody};

/// How a watched body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyEnd {
    /// Every byte was handed to the upstream connection.
    Complete,
    /// Reading from the client failed (it went away mid-upload).
    Failed,
    /// Dropped before its end (the upstream request was abandoned).
    Abandoned,
}

pub struct WatchedBody {
    inner: ProxyBody,
    done: Option<oneshot::Sender<BodyEnd>>,
}

impl WatchedBody {
    /// Wraps `inner`; the receiver learns how it ended.
    pub fn wrap(inner: ProxyBody) -> (ProxyBody, oneshot::Receiver<BodyEnd>) {
        use http_body_util::BodyExt;
        let (tx, rx) = oneshot::channel();
        let body = WatchedBody {
            inner,
            done: Some(tx),
        };
        (body.boxed(), rx)
    }

    fn report(&mut self, end: BodyEnd) {
        if let Some(tx) = self.done.take() {
            let _ = tx.send(end);
        }
    }
}

impl Body for WatchedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.report(BodyEnd::Complete),
            Poll::Ready(Some(Err(_))) => self.report(BodyEnd::Failed),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for WatchedBody {
    fn drop(&mut self) {
        // An empty body may never be polled: it ended all the same.
        let end = if self.inner.is_end_stream() {
            BodyEnd::Complete
        } else {
            BodyEnd::Abandoned
        };
        self.report(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn reports_complete_and_abandoned() {
        let (body, rx) = WatchedBody::wrap(crate::proxy::full("abc"));
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"abc");
        assert_eq!(rx.await.unwrap(), BodyEnd::Complete);

        let never = futures_util::stream::pending::<Result<Frame<Bytes>, BoxError>>();
        let (body, rx) = WatchedBody::wrap(http_body_util::StreamBody::new(never).boxed());
        drop(body);
        assert_eq!(rx.await.unwrap(), BodyEnd::Abandoned);
    }
}
