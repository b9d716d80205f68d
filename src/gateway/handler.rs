//! Where the gateway checks a token: every request passes through
//! [`Gateway::handle`].
//!
//! A request carrying `Fencing-Token` (any method: a fenced read advances
//! the mark too) is verified, then checked and forwarded **under its key's
//! serialization guard**, which is released only when the upstream has
//! finished the response. Writes without a token are refused; reads without
//! one pass unchecked.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::time::Instant;

use super::fence_store::{Decision, FenceError, FenceStore, KeyGuard};
use crate::error::ApiError;
use crate::metrics::GatewayMetrics;
use crate::proxy::forward::{ForwardError, Forwarder};
use crate::proxy::guarded::Guarded;
use crate::proxy::{stream, ProxyBody};
use crate::routes::Routes;
use crate::token::{Claim, Keyring};

pub const TOKEN_HEADER: &str = "fencing-token";
pub const KEY_HEADER: &str = "fencing-key";
/// The per-lease write sequence the sidecar's proxy adds (PITFALLS 5).
pub const SEQ_HEADER: &str = "fencing-seq";

pub struct Gateway {
    pub forwarder: Forwarder,
    pub store: Arc<dyn FenceStore>,
    pub keyring: Keyring,
    pub routes: Routes,
    pub write_methods: Vec<Method>,
    pub enforce: bool,
    pub fence_prefix: String,
    pub serialize_timeout: Duration,
    pub uncertain_hold: Duration,
    pub metrics: Arc<GatewayMetrics>,
}

/// The key guard plus the in-flight gauge it accounts for.
struct InFlight {
    _guard: KeyGuard,
    gauge: prometheus::IntGauge,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

impl Gateway {
    fn count(&self, group: &str, kind: &str, result: &str) {
        self.metrics
            .requests
            .with_label_values(&[group, kind, result])
            .inc();
    }

    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        if req.uri().path().starts_with(&self.fence_prefix) {
            return self.preregister(req).await;
        }
        let kind = if self.write_methods.contains(req.method()) {
            "write"
        } else {
            "read"
        };
        if !self.enforce {
            self.count("none", kind, "unenforced");
            return self.forward(req, None).await;
        }
        if !req.headers().contains_key(TOKEN_HEADER) {
            if kind == "write" {
                self.count("none", kind, "missing_token");
                return ApiError::new(
                    StatusCode::PRECONDITION_REQUIRED,
                    "fencing_token_required",
                    "writes need a Fencing-Token header (send them through the fencer sidecar's proxy)",
                )
                .into_hyper();
            }
            self.count("none", kind, "unchecked");
            return self.forward(req, None).await;
        }
        let claim = match self.verify(&req) {
            Ok(c) => c,
            Err((result, err)) => {
                self.count("none", kind, result);
                return err.into_hyper();
            }
        };
        let seq = match sequence(&req) {
            Ok(s) => s,
            Err(e) => {
                self.count("none", kind, "invalid_sequence");
                return e.into_hyper();
            }
        };
        let group = self.metrics.groups.of(&claim.key);
        let (guard, replay) = match self.check(&claim, seq, &group, kind).await {
            Ok(g) => g,
            Err(resp) => return *resp,
        };
        let resp = self.forward(req, Some(guard)).await;
        let result = if resp.status() == StatusCode::BAD_GATEWAY
            || resp.status() == StatusCode::GATEWAY_TIMEOUT
        {
            "upstream_error"
        } else if replay {
            "replay"
        } else {
            "accepted"
        };
        self.count(&group, kind, result);
        resp
    }

    /// Verifies the signature and that the token's key is the key this
    /// request may touch.
    fn verify(&self, req: &Request<Incoming>) -> Result<Claim, (&'static str, ApiError)> {
        let invalid = |msg: String| {
            (
                "invalid_token",
                ApiError::new(StatusCode::FORBIDDEN, "invalid_fencing_token", msg),
            )
        };
        let raw = req.headers()[TOKEN_HEADER]
            .to_str()
            .map_err(|_| invalid("Fencing-Token is not ASCII".into()))?;
        let claim = self
            .keyring
            .verify(raw)
            .map_err(|e| invalid(format!("Fencing-Token rejected: {e}")))?;
        if i64::try_from(claim.token).is_err() {
            return Err(invalid("token out of range".into()));
        }
        let mismatch = |bound: &str| {
            (
                "key_mismatch",
                ApiError::new(
                    StatusCode::FORBIDDEN,
                    "invalid_fencing_token",
                    format!(
                        "the token is for key `{}`, this request needs `{bound}`",
                        claim.key
                    ),
                ),
            )
        };
        if let Some(header_key) = req.headers().get(KEY_HEADER) {
            if header_key.as_bytes() != claim.key.as_bytes() {
                return Err(mismatch(&String::from_utf8_lossy(header_key.as_bytes())));
            }
        }
        if let Some(bound) = self.routes.key_for(req.uri().path()) {
            if bound != claim.key {
                return Err(mismatch(&bound));
            }
        }
        Ok(claim)
    }

    /// Enters the key's serialization and applies the fencing rule; the
    /// flag says the request is an exact replay of the lease's last write.
    async fn check(
        &self,
        claim: &Claim,
        seq: Option<u64>,
        group: &str,
        kind: &str,
    ) -> Result<(InFlight, bool), Box<Response<ProxyBody>>> {
        let started = Instant::now();
        let entered = self
            .store
            .enter(
                &claim.key,
                claim.token,
                &claim.lease_id,
                seq,
                self.serialize_timeout,
            )
            .await;
        let waited = started.elapsed();
        self.metrics
            .serialization_wait
            .with_label_values(&[group])
            .observe(waited.as_secs_f64());
        self.metrics
            .fence_store_duration
            .with_label_values(&[self.store.name(), "enter"])
            .observe(waited.as_secs_f64());
        let (decision, guard) = match entered {
            Ok(x) => x,
            Err(FenceError::Busy) => {
                self.count(group, kind, "busy");
                return Err(Box::new(
                    ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "fence_busy",
                        "timed out waiting for the previous request on this key",
                    )
                    .with("key", claim.key.as_str())
                    .into_hyper(),
                ));
            }
            Err(e @ FenceError::Unavailable(_)) => {
                self.count(group, kind, "store_error");
                tracing::error!(error = %e, key = %claim.key, "fence store failed");
                return Err(Box::new(
                    ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "fence_store_unavailable",
                        e.to_string(),
                    )
                    .into_hyper(),
                ));
            }
        };
        match decision {
            Decision::Stale { highest } => {
                drop(guard);
                self.count(group, kind, "stale");
                tracing::warn!(
                    key = %claim.key, token = claim.token, highest_seen = highest,
                    lease_id = %claim.lease_id, kind, "stale fencing token rejected"
                );
                return Err(Box::new(stale(claim, highest).into_hyper()));
            }
            Decision::Advanced => {
                self.metrics
                    .token_advances
                    .with_label_values(&[group])
                    .inc();
                tracing::debug!(key = %claim.key, token = claim.token, "fence advanced");
            }
            Decision::StaleSeq { last } => {
                drop(guard);
                self.count(group, kind, "stale_sequence");
                tracing::warn!(
                    key = %claim.key, token = claim.token, seq, last_seq = last,
                    lease_id = %claim.lease_id, kind,
                    "delayed or duplicated write of a lease rejected (sequence below one accepted)"
                );
                return Err(Box::new(
                    ApiError::new(
                        StatusCode::CONFLICT,
                        "stale_sequence",
                        format!(
                            "write {} of this lease arrived after write {last} was accepted: a delayed or duplicated request",
                            seq.unwrap_or(0)
                        ),
                    )
                    .with("key", claim.key.as_str())
                    .with("token", claim.token)
                    .with("seq", seq.unwrap_or(0))
                    .with("last_seq", last)
                    .into_hyper(),
                ));
            }
            Decision::Replay => {
                tracing::info!(
                    key = %claim.key, token = claim.token, seq,
                    "exact replay of the lease's last write let through (idempotent)"
                );
            }
            Decision::Same => {}
        }
        self.metrics.in_flight_keys.inc();
        Ok((
            InFlight {
                _guard: guard,
                gauge: self.metrics.in_flight_keys.clone(),
            },
            decision == Decision::Replay,
        ))
    }

    /// Forwards upstream; `guard` (if any) lives until the response body is
    /// done. If the outcome is unknown, the key stays blocked for
    /// `uncertain_hold`, because the write may still land.
    async fn forward(
        &self,
        req: Request<Incoming>,
        guard: Option<InFlight>,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let result = self.forwarder.forward(req.map(stream)).await;
        let elapsed = started.elapsed().as_secs_f64();
        match result {
            Ok(resp) => {
                self.metrics
                    .upstream_duration
                    .with_label_values(&["ok"])
                    .observe(elapsed);
                match guard {
                    Some(g) => resp.map(|b| Guarded::wrap(stream(b), g)),
                    None => resp.map(stream),
                }
            }
            Err(e) => {
                let outcome = if matches!(e, ForwardError::Timeout(_)) {
                    "timeout"
                } else {
                    "error"
                };
                self.metrics
                    .upstream_duration
                    .with_label_values(&[outcome])
                    .observe(elapsed);
                tracing::warn!(error = %e, "upstream request failed");
                if let Some(g) = guard {
                    let hold = self.uncertain_hold;
                    tokio::spawn(async move {
                        tokio::time::sleep(hold).await;
                        drop(g);
                    });
                }
                let (status, code) = match e {
                    ForwardError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
                    ForwardError::Failed(_) => (StatusCode::BAD_GATEWAY, "upstream_error"),
                };
                ApiError::new(status, code, e.to_string()).into_hyper()
            }
        }
    }

    /// `POST <prefix><key>` with `Fencing-Token`: registers the token before
    /// its holder reads anything, so no earlier holder can write after that.
    async fn preregister(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        if req.method() != Method::POST {
            return ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "use POST",
            )
            .into_hyper();
        }
        let raw_key = &req.uri().path()[self.fence_prefix.len()..];
        let key = match percent_encoding::percent_decode_str(raw_key).decode_utf8() {
            Ok(k) if !k.is_empty() => k.into_owned(),
            _ => return ApiError::invalid("key", "bad key in path").into_hyper(),
        };
        if !self.enforce {
            self.count("none", "preregister", "unenforced");
            return json_ok(json!({"key": key, "advanced": false, "enforced": false}));
        }
        if !req.headers().contains_key(TOKEN_HEADER) {
            self.count("none", "preregister", "missing_token");
            return ApiError::new(
                StatusCode::PRECONDITION_REQUIRED,
                "fencing_token_required",
                "pre-registration needs a Fencing-Token header",
            )
            .into_hyper();
        }
        let claim = match self.verify(&req) {
            Ok(c) if c.key == key => c,
            Ok(c) => {
                self.count("none", "preregister", "key_mismatch");
                return ApiError::new(
                    StatusCode::FORBIDDEN,
                    "invalid_fencing_token",
                    format!("the token is for key `{}`, not `{key}`", c.key),
                )
                .into_hyper();
            }
            Err((result, err)) => {
                self.count("none", "preregister", result);
                return err.into_hyper();
            }
        };
        let group = self.metrics.groups.of(&claim.key);
        match self.check(&claim, None, &group, "preregister").await {
            Ok((guard, _)) => {
                drop(guard);
                self.count(&group, "preregister", "accepted");
                json_ok(
                    json!({"key": claim.key, "token": claim.token, "highest_seen": claim.token, "advanced": true}),
                )
            }
            Err(resp) => *resp,
        }
    }
}

/// The optional `Fencing-Seq` header: a positive integer.
fn sequence(req: &Request<Incoming>) -> Result<Option<u64>, ApiError> {
    let Some(raw) = req.headers().get(SEQ_HEADER) else {
        return Ok(None);
    };
    raw.to_str()
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| (1..=i64::MAX as u64).contains(s))
        .map(Some)
        .ok_or_else(|| {
            ApiError::invalid(
                "Fencing-Seq",
                "Fencing-Seq must be an integer between 1 and 2^63-1",
            )
        })
}

fn stale(claim: &Claim, highest: u64) -> ApiError {
    let message = if claim.token == highest {
        format!(
            "token {} for `{}` belongs to another lease; the lock has moved on",
            claim.token, claim.key
        )
    } else {
        format!(
            "token {} for `{}` is older than {highest}, already accepted: this holder lost its lock",
            claim.token, claim.key
        )
    };
    ApiError::new(StatusCode::CONFLICT, "stale_fencing_token", message)
        .with("key", claim.key.as_str())
        .with("token", claim.token)
        .with("highest_seen", highest)
}

fn json_ok(body: serde_json::Value) -> Response<ProxyBody> {
    Response::builder()
        .status(StatusCode::OK)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(crate::proxy::full(body.to_string()))
        .expect("static response parts")
}
