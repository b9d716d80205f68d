//! The egress proxy: the application's storage requests leave through here
//! and, when they name a lock this sidecar holds, carry its signed token.
//!
//! The request names the lease it was computed under, `Fencing-Lease:
//! <lease_id>` (required by default: with several workers sharing one
//! sidecar, "whatever lease holds the key now" may be another worker's, and
//! a paused worker's write would go out with that worker's token — issue 10
//! item 2). The key is the lease's, or named by `Fencing-Lock: <key>`, or
//! found from the path by the configured routes (matched on the path's
//! normal form, which is also the form forwarded); when both are given they
//! must agree. A request carrying any `Fencing-*` header twice is refused
//! (400 `duplicate_fencing_header`); every `Fencing-*` header the
//! application sends is stripped: only the sidecar may vouch for a token. A request for a lock
//! that is not held (428) or whose lease is lost or past its local deadline
//! (409) is answered here and never forwarded — that is the fail-fast half
//! of fencing; the gateway is the half that cannot be bypassed.
//!
//! Requests under one lease are numbered (`Fencing-Seq`) and sent one at a
//! time, each after the previous one's response head came back, so the
//! gateway sees them in order and can refuse a delayed or duplicated earlier
//! one that arrives after a later one (PITFALLS 5). Two things keep that
//! order honest:
//! - the lease is checked again *after* the request's turn came, and the
//!   wait for the turn is bounded by the lease's remaining time: a request
//!   queued behind a slow one must not leave with a token whose deadline
//!   passed while it waited (issue 9 item 3);
//! - once numbered, a request is forwarded by a task of its own that holds
//!   the lease's turn until the answer: a client that goes away cannot let
//!   the next request of the lease overtake it (issue 9 item 1).
//!
//! Sequence numbers come from [`super::sequence`]: increasing within a
//! process and above anything an earlier process gave the same lease, so a
//! lease adopted after a sidecar restart can go on writing (issue 9 item 7)
//! — with `sidecar.state_dir`, even when the clock stepped back across the
//! restart (issue 27 item 7).

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use tokio::time::Instant;
use tracing::Instrument;

use super::locks::{LockError, LockManager};
use crate::error::ApiError;
use crate::lock::{LeaseId, LockKey};
use crate::metrics::Metrics;
use crate::proxy::forward::{strip_hop_by_hop, Forwarder};
use crate::proxy::{stream, ProxyBody};
use crate::routes::Routes;

use crate::proxy::headers::{LEASE as LEASE_HEADER, LOCK as LOCK_HEADER};

pub struct Egress {
    /// Numbers each lease's requests (`Fencing-Seq`).
    pub sequencer: Arc<super::sequence::Sequencer>,
    pub locks: Arc<LockManager>,
    /// How long a request waits for the lease's previous one to get its
    /// response head (at most: never past the lease's deadline).
    pub order_wait: Duration,
    pub forwarder: Forwarder,
    pub routes: Routes,
    /// Every other method is a write.
    pub read_methods: Vec<Method>,
    pub require_lock_for_writes: bool,
    /// Requests under a lock must name their lease.
    pub require_lease: bool,
    pub metrics: Arc<Metrics>,
}

impl Egress {
    fn done(&self, result: &str, started: Instant) {
        crate::telemetry::spans::outcome(result);
        self.metrics
            .proxy_requests
            .with_label_values(&[result])
            .inc();
        self.metrics
            .proxy_duration
            .with_label_values(&[result])
            .observe(started.elapsed().as_secs_f64());
    }

    fn refuse(&self, result: &str, started: Instant, err: ApiError) -> Response<ProxyBody> {
        self.done(result, started);
        err.into_hyper()
    }

    pub async fn handle(self: Arc<Self>, mut req: Request<Incoming>) -> Response<ProxyBody> {
        let started = Instant::now();
        // First, before adding anything: a `Connection` header naming one
        // of our headers must not strip it on the way out.
        strip_hop_by_hop(req.headers_mut());
        // A `Fencing-*` header twice is refused, not read by its first value
        // (issue 26 item 9): which of two `Fencing-Lease` values names the
        // lease would be a guess.
        if let Some(name) = crate::proxy::headers::duplicated(req.headers()) {
            tracing::info!(header = %name, "proxied request refused: a Fencing-* header appears twice");
            return self.refuse(
                "bad_request",
                started,
                crate::proxy::headers::duplicate_error(&name),
            );
        }
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

        let is_write = !crate::proxy::headers::is_read(&self.read_methods, req.method());
        let named = lock.is_some() || lease.is_some() || !self.routes.is_empty();
        if named || is_write {
            if let Err(e) = normalize_uri(&mut req) {
                return self.refuse("bad_request", started, e);
            }
        }

        let bound_lease = match lease.map(|v| v.to_str().ok().and_then(LeaseId::parse)) {
            None => None,
            Some(Some(l)) => Some(l),
            Some(None) => {
                return self.refuse(
                    "bad_request",
                    started,
                    ApiError::invalid("Fencing-Lease", "Fencing-Lease must be a lease id"),
                );
            }
        };
        let named_key = match lock {
            Some(v) => match std::str::from_utf8(v.as_bytes()).ok().map(LockKey::parse) {
                Some(Ok(k)) => Some(k),
                _ => {
                    return self.refuse("bad_request", started, ApiError::invalid("Fencing-Lock", "Fencing-Lock must be a valid lock key (1-512 bytes of UTF-8, no control characters)"));
                }
            },
            None => match self
                .routes
                .key_for(req.uri().path())
                .map(|k| LockKey::parse(&k))
            {
                Some(Ok(k)) => Some(k),
                Some(Err(e)) => {
                    return self.refuse(
                        "bad_request",
                        started,
                        ApiError::invalid("path", format!("route gives an invalid key: {e}")),
                    );
                }
                None => None,
            },
        };

        let key = match (named_key, &bound_lease) {
            (Some(k), _) => k,
            // The lease names its key.
            (None, Some(lease)) => match self.locks.key_of_lease(lease) {
                Some(k) => k,
                None if self.locks.group(lease).is_some() => {
                    return self.refuse(
                        "lock_not_held",
                        started,
                        ApiError::new(
                            StatusCode::PRECONDITION_REQUIRED,
                            "lock_not_held",
                            "a multi-key lease covers several keys: name the one this request writes (Fencing-Lock or a configured route)",
                        ),
                    );
                }
                None => {
                    let ended = self.locks.lease_ended_here(lease);
                    return self.refused_unknown_lease(ended, started);
                }
            },
            (None, None) => {
                if self.require_lock_for_writes && is_write {
                    return self.refuse(
                        "lock_not_held",
                        started,
                        ApiError::new(
                            StatusCode::PRECONDITION_REQUIRED,
                            "lock_not_held",
                            "writes must name a lock (Fencing-Lease, Fencing-Lock or a configured route)",
                        ),
                    );
                }
                return self.forward_passthrough(req, started).await;
            }
        };
        if bound_lease.is_none() && self.require_lease {
            return self.refuse(
                "lease_required",
                started,
                ApiError::new(
                    StatusCode::PRECONDITION_REQUIRED,
                    "lease_required",
                    "name the lease this request was computed under: Fencing-Lease: <lease_id from the acquire response> (proxy.require_lease)",
                )
                .with("key", key.as_str()),
            );
        }

        // A read lease is tracked under a key of its own.
        let key = match &bound_lease {
            Some(lease) => self.locks.lease_key(&key, lease),
            None => key,
        };
        let record = match self.locks.lease_for_write(&key, bound_lease.as_ref()) {
            Ok(r) => r,
            Err(e) => return self.refused_lease(&key, e, started),
        };
        if is_write && key.is_reader() {
            // The gateway would refuse it too; it never leaves here.
            tracing::info!(key = %key, method = %req.method(), "write under a read lease refused");
            return self.refuse(
                "read_lease",
                started,
                ApiError::new(
                    StatusCode::CONFLICT,
                    "read_lease",
                    "the lease named by Fencing-Lease is a read lease: readers share the key and may not write (acquire it with \"mode\": \"write\")",
                )
                .with("key", key.as_str()),
            );
        }
        crate::telemetry::spans::lock(key.as_str(), Some(record.token));
        // A proxied request is a sign of life for an auto-renewed lease.
        self.locks.touch(&key, Some(&record.lease_id));

        // The lease's turn: after its previous request's answer, and never
        // past the lease's deadline.
        let wait = self
            .order_wait
            .min(record.deadline.saturating_duration_since(Instant::now()));
        let turn = match tokio::time::timeout(wait, record.writes.clone().lock_owned()).await {
            Ok(turn) => turn,
            Err(_) => {
                if Instant::now() >= record.deadline {
                    return self.refused_lease(&key, LockError::LeaseLost(key.clone()), started);
                }
                tracing::warn!(key = %key, "previous request of this lease still in flight");
                return self.refuse(
                    "lease_busy",
                    started,
                    ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "lease_busy",
                        "the previous request under this lease has not been answered yet",
                    )
                    .with("key", key.as_str()),
                );
            }
        };
        // Numbered first (this may wait for a reservation on disk), then
        // checked again: the lease may have been lost, or its deadline
        // passed, while we waited.
        let mut turn = turn;
        *turn = self.sequencer.next(*turn).await;
        let record = match self.locks.lease_for_write(&key, Some(&record.lease_id)) {
            Ok(r) => r,
            Err(e) => return self.refused_lease(&key, e, started),
        };
        // The fault suite checks from these lines that no token went out
        // past its lease's local deadline (left_ms > 0).
        tracing::debug!(
            key = %key, token = record.token, seq = *turn, lease_tag = %record.lease_id.tag(),
            left_ms = record.deadline.saturating_duration_since(Instant::now()).as_millis() as u64,
            past_deadline = Instant::now() >= record.deadline,
            "token injected"
        );
        let headers = req.headers_mut();
        if let Ok(v) = HeaderValue::from_bytes(key.as_str().as_bytes()) {
            headers.insert(HeaderName::from_static("fencing-key"), v);
        }
        headers.insert(
            HeaderName::from_static("fencing-token"),
            HeaderValue::from_str(&record.fencing_token).expect("tokens are ASCII"),
        );
        headers.insert(
            HeaderName::from_static(crate::proxy::headers::SEQ),
            HeaderValue::from(*turn),
        );
        // From here the request is numbered: it goes out and the lease's
        // turn is held until its answer, whatever its client does.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let this = self.clone();
        tokio::spawn(
            async move {
                let resp = this.forward(req, "forwarded", started).await;
                drop(turn);
                let _ = tx.send(resp);
            }
            .in_current_span(),
        );
        rx.await.unwrap_or_else(|_| {
            ApiError::internal("the forward ended without an answer").into_hyper()
        })
    }

    /// A `Fencing-Lease` that holds no key here: lost or ended (409) or
    /// never seen (428).
    fn refused_unknown_lease(&self, ended: bool, started: Instant) -> Response<ProxyBody> {
        let (result, err) = match ended {
            true => (
                "lease_lost",
                ApiError::new(
                    StatusCode::CONFLICT,
                    "lease_lost",
                    "the lease named by Fencing-Lease no longer holds its lock",
                ),
            ),
            false => (
                "lock_not_held",
                ApiError::new(
                    StatusCode::PRECONDITION_REQUIRED,
                    "lock_not_held",
                    "the lease named by Fencing-Lease holds no lock in this sidecar",
                ),
            ),
        };
        tracing::info!(result, "proxied request refused");
        self.refuse(result, started, err)
    }

    fn refused_lease(&self, key: &LockKey, e: LockError, started: Instant) -> Response<ProxyBody> {
        let result = match &e {
            LockError::LeaseLost(_) => "lease_lost",
            _ => "lock_not_held",
        };
        tracing::info!(key = %key, result, "proxied request refused");
        self.refuse(result, started, ApiError::from(e))
    }

    async fn forward_passthrough(
        &self,
        req: Request<Incoming>,
        started: Instant,
    ) -> Response<ProxyBody> {
        self.forward(req, "passthrough", started).await
    }

    async fn forward(
        &self,
        req: Request<Incoming>,
        result: &str,
        started: Instant,
    ) -> Response<ProxyBody> {
        let sending = self.forwarder.forward(req.map(stream));
        match crate::telemetry::spans::forwarded("proxy.forward", sending).await {
            Ok(resp) => {
                self.done(result, started);
                resp.map(stream)
            }
            Err(e) => {
                self.done("upstream_error", started);
                tracing::warn!(error = %e, "proxy upstream failed");
                e.to_response()
            }
        }
    }
}

/// Rewrites the request's path to its normal form, or refuses it: a path
/// with no one meaning must not go out with a token, and the key a route
/// finds must be the key of the path the storage will see.
fn normalize_uri(req: &mut Request<Incoming>) -> Result<(), ApiError> {
    *req.uri_mut() = crate::routes::path::normalize_uri(req.uri()).map_err(|e| {
        ApiError::invalid(
            "path",
            format!("{e}: requests under a lock need an unambiguous path"),
        )
    })?;
    Ok(())
}
