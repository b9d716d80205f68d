//! The egress proxy: the application's storage requests leave through here
//! and, when they name a lock this sidecar holds, carry its signed token.
//!
//! The lock is named by `Fencing-Lock: <key>` or found from the path by the
//! configured routes. Every `Fencing-*` header the application sends is
//! stripped: only the sidecar may vouch for a token. A request for a lock
//! that is not held (428) or whose lease is lost or past its local deadline
//! (409) is answered here and never forwarded — that is the fail-fast half
//! of fencing; the gateway is the half that cannot be bypassed.
//!
//! Requests under one lease are numbered (`Fencing-Seq`: 1, 2, 3, …) and
//! sent one at a time, each after the previous one's response head came
//! back, so the gateway sees them in order and can refuse a delayed or
//! duplicated earlier one that arrives after a later one (PITFALLS 5).

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use tokio::time::Instant;

use super::locks::LockManager;
use crate::error::ApiError;
use crate::lock::{LeaseId, LockKey};
use crate::metrics::Metrics;
use crate::proxy::forward::{ForwardError, Forwarder};
use crate::proxy::{stream, ProxyBody};
use crate::routes::Routes;

pub const LOCK_HEADER: &str = "fencing-lock";
pub const LEASE_HEADER: &str = "fencing-lease";

pub struct Egress {
    pub locks: Arc<LockManager>,
    /// How long a request waits for the lease's previous one to get its
    /// response head.
    pub order_wait: std::time::Duration,
    pub forwarder: Forwarder,
    pub routes: Routes,
    pub write_methods: Vec<Method>,
    pub require_lock_for_writes: bool,
    pub metrics: Arc<Metrics>,
}

impl Egress {
    fn done(&self, result: &str, started: Instant) {
        self.metrics
            .proxy_requests
            .with_label_values(&[result])
            .inc();
        self.metrics
            .proxy_duration
            .with_label_values(&[result])
            .observe(started.elapsed().as_secs_f64());
    }

    pub async fn handle(self: Arc<Self>, mut req: Request<Incoming>) -> Response<ProxyBody> {
        let started = Instant::now();
        let headers = req.headers_mut();
        let lock = headers.get(LOCK_HEADER).cloned();
        let lease = headers.get(LEASE_HEADER).cloned();
        let fencing: Vec<HeaderName> = headers
            .keys()
            .filter(|n| n.as_str().starts_with("fencing-"))
            .cloned()
            .collect();
        for name in fencing {
            headers.remove(name);
        }

        let key = match lock {
            Some(v) => match std::str::from_utf8(v.as_bytes()).ok().map(LockKey::parse) {
                Some(Ok(k)) => Some(k),
                _ => {
                    self.done("bad_request", started);
                    return ApiError::invalid("Fencing-Lock", "Fencing-Lock must be a valid lock key (1-512 bytes of UTF-8, no control characters)").into_hyper();
                }
            },
            None => match self
                .routes
                .key_for(req.uri().path())
                .map(|k| LockKey::parse(&k))
            {
                Some(Ok(k)) => Some(k),
                Some(Err(e)) => {
                    self.done("bad_request", started);
                    return ApiError::invalid("path", format!("route gives an invalid key: {e}"))
                        .into_hyper();
                }
                None => None,
            },
        };

        let Some(key) = key else {
            if self.require_lock_for_writes && self.write_methods.contains(req.method()) {
                self.done("lock_not_held", started);
                return ApiError::new(
                    StatusCode::PRECONDITION_REQUIRED,
                    "lock_not_held",
                    "writes must name a lock (Fencing-Lock header or a configured route)",
                )
                .into_hyper();
            }
            return self.forward(req, "passthrough", started).await;
        };

        let bound_lease = match lease.map(|v| v.to_str().ok().and_then(LeaseId::parse)) {
            None => None,
            Some(Some(l)) => Some(l),
            Some(None) => {
                self.done("bad_request", started);
                return ApiError::invalid("Fencing-Lease", "Fencing-Lease must be a lease id")
                    .into_hyper();
            }
        };

        let record = match self.locks.lease_for_write(&key, bound_lease.as_ref()) {
            Ok(r) => r,
            Err(e) => {
                let result = match &e {
                    super::locks::LockError::LeaseLost(_) => "lease_lost",
                    _ => "lock_not_held",
                };
                self.done(result, started);
                tracing::info!(key = %key, result, "proxied request refused");
                return ApiError::from(e).into_hyper();
            }
        };
        // A proxied request is a sign of life for an auto-renewed lease.
        self.locks.touch(&key, Some(&record.lease_id));
        let headers = req.headers_mut();
        match HeaderValue::from_bytes(key.as_str().as_bytes()) {
            Ok(v) => headers.insert(HeaderName::from_static("fencing-key"), v),
            Err(_) => None,
        };
        headers.insert(
            HeaderName::from_static("fencing-token"),
            HeaderValue::from_str(&record.fencing_token).expect("tokens are ASCII"),
        );
        let mut sequence =
            match tokio::time::timeout(self.order_wait, record.writes.clone().lock_owned()).await {
                Ok(guard) => guard,
                Err(_) => {
                    self.done("lease_busy", started);
                    tracing::warn!(key = %key, "previous request of this lease still in flight");
                    return ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "lease_busy",
                        "the previous request under this lease has not been answered yet",
                    )
                    .with("key", key.as_str())
                    .into_hyper();
                }
            };
        *sequence += 1;
        req.headers_mut().insert(
            HeaderName::from_static(crate::gateway::handler::SEQ_HEADER),
            HeaderValue::from(*sequence),
        );
        // Released when the response head is back (or the forward failed):
        // the next request of the lease is numbered and sent after this one.
        let resp = self.forward(req, "forwarded", started).await;
        drop(sequence);
        resp
    }

    async fn forward(
        &self,
        req: Request<Incoming>,
        result: &str,
        started: Instant,
    ) -> Response<ProxyBody> {
        match self.forwarder.forward(req.map(stream)).await {
            Ok(resp) => {
                self.done(result, started);
                resp.map(stream)
            }
            Err(e) => {
                self.done("upstream_error", started);
                tracing::warn!(error = %e, "proxy upstream failed");
                let (status, code) = match e {
                    ForwardError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
                    ForwardError::Failed(_) => (StatusCode::BAD_GATEWAY, "upstream_error"),
                };
                ApiError::new(status, code, e.to_string()).into_hyper()
            }
        }
    }
}
