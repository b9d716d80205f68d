//! A response body that keeps something alive until the body is done.
//!
//! The gateway holds a key's serialization guard until the upstream has
//! finished the response (or the client went away), not merely until the
//! headers arrived.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::{BoxError, ProxyBody};

pub struct Guarded<G> {
    inner: ProxyBody,
    guard: Option<G>,
}

impl<G: Send + Sync + Unpin + 'static> Guarded<G> {
    pub fn wrap(inner: ProxyBody, guard: G) -> ProxyBody {
        use http_body_util::BodyExt;
        Guarded {
            inner,
            guard: Some(guard),
        }
        .boxed()
    }
}

impl<G: Unpin> Body for Guarded<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) | Poll::Ready(Some(Err(_))) = &polled {
            self.guard = None;
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
