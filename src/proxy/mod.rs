//! HTTP forwarding shared by the sidecar's egress proxy and the gateway:
//! raw hyper, streaming bodies both ways, pooled keep-alive upstream
//! connections, bounded timeouts.

pub mod forward;
pub mod headers;
pub mod watched_body;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type on both sides of a proxy: the client's streaming body
/// going up, the upstream's streaming body (or a small JSON error) coming
/// back.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

pub fn stream(body: hyper::body::Incoming) -> ProxyBody {
    body.map_err(|e| Box::new(e) as BoxError).boxed()
}
