//! The spans of fencer's hops, made with `tracing` under one target
//! ([`TARGET`]) that only the OpenTelemetry layer listens to: log lines
//! look exactly as they did before tracing existed, and with tracing off
//! no span is built at all.
//!
//! Names (`otel.name`): `lock.acquire|renew|release|hold|keepalive|get|list`
//! (lock API), `dapr.lock|unlock|lease`, `dapr.grpc.try_lock|unlock`
//! (Dapr's lock API over HTTP and gRPC), `proxy.request` → `proxy.forward` (egress proxy),
//! `gateway.request` → `gateway.check`, `gateway.forward` (gateway).
//! Attributes: `fencer.lock.key` and `fencer.token` (as in the logs; span
//! attributes are per request, never metric labels), `fencer.outcome` (the
//! result the role's metrics count), `fencer.error` (the JSON error code),
//! `http.response.status_code`; 5xx answers mark the span as an error.

use std::future::Future;

use hyper::body::Incoming;
use hyper::{Request, Response};
use tracing::field::Empty;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::error::ErrorCode;

/// The `tracing` target of every span meant for OpenTelemetry.
pub const TARGET: &str = "fencer::otel";

macro_rules! hop_span {
    ($name:expr, $kind:literal) => {
        tracing::info_span!(
            target: TARGET,
            "fencer",
            otel.name = $name,
            otel.kind = $kind,
            otel.status_code = Empty,
            fencer.lock.key = Empty,
            fencer.token = Empty,
            fencer.outcome = Empty,
            fencer.error = Empty,
            http.request.method = Empty,
            http.response.status_code = Empty,
        )
    };
}

/// The span of one request received (`otel.kind = server`), child of the
/// caller's `traceparent` when it sent exactly one.
pub fn server(name: &'static str, req: &Request<impl Sized>) -> Span {
    if !super::tracing_enabled() {
        return Span::none();
    }
    let span = hop_span!(name, "server");
    span.record("http.request.method", req.method().as_str());
    if let Some(cx) = super::propagation::extract(req.headers()) {
        // Fails only for a span no layer records: nothing to link then.
        let _ = span.set_parent(cx);
    }
    span
}

/// The span of one request sent to the next hop (`otel.kind = client`),
/// child of the current span; its context is what the request carries.
pub fn client(name: &'static str) -> Span {
    if !super::tracing_enabled() {
        return Span::none();
    }
    hop_span!(name, "client")
}

/// A step inside a request (`otel.kind = internal`).
pub fn internal(name: &'static str) -> Span {
    if !super::tracing_enabled() {
        return Span::none();
    }
    hop_span!(name, "internal")
}

/// Runs `handle` for `req` inside a server span named `name`, and records
/// the answer on it.
pub fn serve<F, B>(
    name: &'static str,
    req: Request<Incoming>,
    handle: impl FnOnce(Request<Incoming>) -> F,
) -> impl Future<Output = Response<B>>
where
    F: Future<Output = Response<B>>,
{
    let span = server(name, &req);
    let answer = {
        let _entered = span.enter();
        handle(req)
    };
    async move {
        let resp = answer.await;
        record_response(&Span::current(), &resp);
        resp
    }
    .instrument(span)
}

/// Sends a request to the next hop inside a client span named `name`
/// (whose context the request carries) and records the answer, or the
/// failure (`fencer.error = <outcome>`, status error), on it.
pub async fn forwarded<B, E: ForwardOutcome>(
    name: &'static str,
    sending: impl Future<Output = Result<Response<B>, E>>,
) -> Result<Response<B>, E> {
    let span = client(name);
    let result = sending.instrument(span.clone()).await;
    match &result {
        Ok(resp) => record_response(&span, resp),
        Err(e) => {
            span.record("fencer.error", e.outcome());
            span.record("otel.status_code", "error");
        }
    }
    result
}

/// A failed forward's outcome label (`timeout`, `error`).
pub trait ForwardOutcome {
    fn outcome(&self) -> &'static str;
}

impl ForwardOutcome for crate::proxy::forward::ForwardError {
    fn outcome(&self) -> &'static str {
        crate::proxy::forward::ForwardError::outcome(self)
    }
}

/// The status of an answer, and its error code if it is a JSON error.
pub fn record_response<B>(span: &Span, resp: &Response<B>) {
    if span.is_disabled() {
        return;
    }
    let status = resp.status();
    span.record("http.response.status_code", status.as_u16());
    if let Some(ErrorCode(code)) = resp.extensions().get::<ErrorCode>() {
        span.record("fencer.error", *code);
    }
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// The result the role counted (`forwarded`, `stale_token`, …), on the
/// current span.
pub fn outcome(result: &str) {
    if !super::tracing_enabled() {
        return;
    }
    Span::current().record("fencer.outcome", result);
}

/// The lock key (and token, where one is known) on the current span.
pub fn lock(key: &str, token: Option<u64>) {
    if !super::tracing_enabled() {
        return;
    }
    let span = Span::current();
    span.record("fencer.lock.key", key);
    if let Some(token) = token {
        span.record("fencer.token", token);
    }
}

/// axum middleware of the lock API: one server span per keyed call,
/// named by its route; its outcome is `ok` or the error code.
pub async fn lock_api(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str());
    let name = match route {
        _ if !super::tracing_enabled() => None,
        Some("/v1/locks/{key}/acquire") => Some("lock.acquire"),
        Some("/v1/locks/{key}/renew") => Some("lock.renew"),
        Some("/v1/locks/{key}/release") => Some("lock.release"),
        Some("/v1/locks/{key}/hold") => Some("lock.hold"),
        Some("/v1/locks/{key}/keepalive") => Some("lock.keepalive"),
        Some("/v1/locks/{key}") => Some("lock.get"),
        Some("/v1/locks") => Some("lock.list"),
        Some("/v1.0-alpha1/lock/{store}") => Some("dapr.lock"),
        Some("/v1.0-alpha1/unlock/{store}") => Some("dapr.unlock"),
        Some("/v1/dapr/{store}/lease") => Some("dapr.lease"),
        Some("/dapr.proto.runtime.v1.Dapr/TryLockAlpha1") => Some("dapr.grpc.try_lock"),
        Some("/dapr.proto.runtime.v1.Dapr/UnlockAlpha1") => Some("dapr.grpc.unlock"),
        _ => None,
    };
    let Some(name) = name else {
        return next.run(req).await;
    };
    let span = server(name, &req);
    async move {
        let resp = next.run(req).await;
        let span = Span::current();
        record_response(&span, &resp);
        // A gRPC answer is HTTP 200 whatever happened: its outcome is the
        // `grpc-status` it carries (trailers-only answers put it in the
        // headers, which is how every Dapr error here is sent).
        let grpc_status = resp
            .headers()
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .filter(|s| *s != "0");
        match (resp.extensions().get::<ErrorCode>(), grpc_status) {
            (Some(c), _) => span.record("fencer.outcome", c.0),
            (None, Some(status)) => span.record("fencer.outcome", format!("grpc_status_{status}")),
            (None, None) => span.record("fencer.outcome", "ok"),
        };
        resp
    }
    .instrument(span)
    .await
}
