//! The forward of one fenced request: admission, forward, and holding the
//! key until the storage can no longer be changed by it.
//!
//! All of it runs in a task of its own ([`forward`] spawns it and only
//! waits for the response head). In tokio, a client that disconnects or
//! times out makes hyper drop its request's future at the current `.await`:
//! had the key's turn lived in that future, the key would unlock while the
//! storage might still apply the write, and a newer write could land before
//! it (issue 9 item 1; the sidecar's own proxy caused it with default
//! timeouts). The task does not care whether its client is still there.

use std::sync::Arc;

use base64::Engine;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::fence_store::{Decision, FenceError, Stamp};
use super::key_queue::KeyTurn;
use super::state::Gateway;
use crate::error::ApiError;
use crate::proxy::watched_body::WatchedBody;
use crate::proxy::{stream, ProxyBody};
use crate::token::Claim;

/// Forwards a verified fenced request from its own task; returns the
/// response (head) for the client.
pub(super) async fn forward(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
    claim: Claim,
    seq: Option<u64>,
    kind: &'static str,
    check: Span,
) -> Response<ProxyBody> {
    let group = gw.metrics.group(&claim.key);
    let (tx, rx) = oneshot::channel();
    let task = Fenced {
        gw,
        claim,
        seq,
        kind,
        group,
        check,
    };
    if crate::mutants::active("guard_in_request") {
        // Mutant: the hold lives in the client's request future again.
        task.run(req, tx).await;
    } else {
        let tracker = task.gw.tasks.clone();
        tracker.spawn(task.run(req, tx).in_current_span());
    }
    rx.await.unwrap_or_else(|_| {
        ApiError::internal("the fenced forward ended without an answer").into_hyper()
    })
}

struct Fenced {
    gw: Arc<Gateway>,
    claim: Claim,
    seq: Option<u64>,
    kind: &'static str,
    group: String,
    /// `gateway.check`: the wait for the key's turn and the admission.
    check: Span,
}

/// A fenced request's hold on its key: the turn in this process and the
/// in-flight stamp in the fence store. Owned by the forward's task, never
/// by the client's request future. [`KeyHold::release`] gives it up once
/// the storage can no longer be changed by the request (after the uncertain
/// hold if the outcome is unknown). If the task dies instead, the turn is
/// dropped with it but the stamp stays until it runs out, which still keeps
/// other replicas off the key for as long as the write could land.
struct KeyHold {
    gw: Arc<Gateway>,
    key: String,
    stamp: Stamp,
    turn: Option<KeyTurn>,
}

impl KeyHold {
    /// `uncertain`: why the storage's outcome is unknown, with when the
    /// request was forwarded. The key then stays blocked until the upstream
    /// timeout would have run out, plus `uncertain_hold`, whenever the
    /// gateway gave up: a connection that broke early (a reset) says nothing
    /// about when the storage applies the write, so giving up early must not
    /// shorten the window (the fault suite's long tier found that it did).
    /// The precondition this leaves is one bound for every case: the storage
    /// applies a write, or never will, within `upstream_timeout_ms +
    /// uncertain_hold_ms` of its forward.
    async fn release(mut self, uncertain: Option<(&'static str, Instant)>) {
        if let Some((cause, forwarded_at)) = uncertain {
            self.gw.metrics.uncertain.with_label_values(&[cause]).inc();
            let until = Instant::now().max(forwarded_at + self.gw.upstream_timeout)
                + self.gw.uncertain_hold;
            tracing::warn!(
                key = %self.key, cause,
                hold_ms = until.saturating_duration_since(Instant::now()).as_millis() as u64,
                "outcome at the storage unknown; key stays blocked"
            );
            tokio::time::sleep_until(until).await;
        }
        let mut cleared = crate::mutants::active("stamp_never_cleared");
        for attempt in 0..3u32 {
            if cleared {
                break;
            }
            match self.gw.store.finish(&self.key, &self.stamp.id).await {
                Ok(()) => {
                    cleared = true;
                    break;
                }
                Err(e) => {
                    tracing::warn!(key = %self.key, attempt, error = %e, "could not clear the in-flight stamp");
                    tokio::time::sleep(std::time::Duration::from_millis(100 << attempt)).await;
                }
            }
        }
        if !cleared {
            self.gw.metrics.finish_errors.inc();
        }
        drop(self.turn.take());
    }
}

impl Drop for KeyHold {
    fn drop(&mut self) {
        self.gw.metrics.in_flight_keys.dec();
    }
}

fn stamp_id() -> String {
    let mut b = [0u8; 12];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut b);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

impl Fenced {
    fn count(&self, result: &str) {
        crate::telemetry::spans::outcome(result);
        self.gw
            .metrics
            .requests
            .with_label_values(&[self.group.as_str(), self.kind, result])
            .inc();
    }

    async fn run(mut self, req: Request<Incoming>, reply: oneshot::Sender<Response<ProxyBody>>) {
        let gw = self.gw.clone();
        let started = Instant::now();
        let deadline = started + gw.serialize_timeout;
        let key = self.claim.key.clone();
        // Taken out: the span ends at the decision, not with the task.
        let check = std::mem::replace(&mut self.check, Span::none());
        let Some(turn) = gw.keys.turn(&key, deadline).instrument(check.clone()).await else {
            check.record("fencer.outcome", "busy");
            self.count("busy");
            let _ = reply.send(busy(&key));
            return;
        };
        if reply.is_closed() {
            // The client left while the request waited for its turn:
            // nothing was sent yet, so nothing needs to be.
            gw.metrics.client_gone.inc();
            self.count("client_gone");
            return;
        }
        let stamp = Stamp {
            id: stamp_id(),
            hold: gw.stamp_hold,
        };
        let store_started = Instant::now();
        let admitted = gw
            .store
            .admit(
                &key,
                super::fence_store::Presented::new(
                    self.claim.token,
                    &self.claim.lease,
                    self.seq,
                    self.claim.mode,
                ),
                Some(&stamp),
                deadline,
            )
            .instrument(check.clone())
            .await;
        gw.metrics
            .serialization_wait
            .with_label_values(&[self.group.as_str()])
            .observe(started.elapsed().as_secs_f64());
        gw.metrics
            .fence_store_duration
            .with_label_values(&[gw.store.name(), "admit"])
            .observe(store_started.elapsed().as_secs_f64());
        let decision = match admitted {
            Ok(a) => {
                super::fence_store::jump_alarm(&gw.metrics, &self.group, &self.claim, &a);
                a.decision
            }
            Err(e) => {
                check.record("fencer.outcome", "store_error");
                let _ = reply.send(self.store_failure(e));
                return;
            }
        };
        if let Err(resp) = self.decided(&decision) {
            check.record("fencer.outcome", "refused");
            let _ = reply.send(*resp);
            return;
        }
        check.record("fencer.outcome", "admitted");
        drop(check);
        gw.metrics.in_flight_keys.inc();
        let hold = KeyHold {
            gw: gw.clone(),
            key: key.clone(),
            stamp,
            turn: Some(turn),
        };
        let hold = if crate::mutants::active("check_then_forward") {
            // Mutant: checked, then forwarded unguarded.
            hold.release(None).await;
            None
        } else {
            Some(hold)
        };

        let (parts, incoming) = req.into_parts();
        let (body, body_end) = WatchedBody::wrap(stream(incoming));
        let req = Request::from_parts(parts, body);
        let forwarded_at = Instant::now();
        // Reads are the methods known not to change the storage
        // (`gateway.read_methods`): once the storage answered or gave up,
        // nothing of a read can still land, so its key is not held for the
        // uncertain window (issue 26 item 7: a GET's 504 held up the next
        // write for the whole hold). A write's outcome may be unknown.
        let is_read = self.kind == "read";
        let sending = gw.forwarder.forward(req);
        let uncertain = match crate::telemetry::spans::forwarded("gateway.forward", sending).await {
            Ok(resp) => {
                gw.metrics
                    .upstream_duration
                    .with_label_values(&["ok"])
                    .observe(forwarded_at.elapsed().as_secs_f64());
                self.count("accepted");
                if reply.send(storage_answer(resp)).is_err() {
                    gw.metrics.client_gone.inc();
                }
                if is_read {
                    None
                } else {
                    // The storage decided; the upload may still be flowing.
                    let body_deadline = forwarded_at + gw.upstream_timeout;
                    match tokio::time::timeout_at(body_deadline, body_end).await {
                        Ok(_) => None,
                        Err(_) => Some(("request_body", forwarded_at)),
                    }
                }
            }
            Err(e) => {
                gw.metrics
                    .upstream_duration
                    .with_label_values(&[e.outcome()])
                    .observe(forwarded_at.elapsed().as_secs_f64());
                tracing::warn!(key = %key, error = %e, kind = self.kind, "upstream request failed");
                self.count("upstream_error");
                if reply.send(e.to_response()).is_err() {
                    gw.metrics.client_gone.inc();
                }
                if is_read {
                    tracing::debug!(key = %key, "a read's outcome is unknown; reads change nothing, the key is not held");
                    None
                } else {
                    Some((e.outcome(), forwarded_at))
                }
            }
        };
        if let Some(hold) = hold {
            hold.release(uncertain).await;
        }
    }

    /// What a store failure answers.
    fn store_failure(&self, e: FenceError) -> Response<ProxyBody> {
        match e {
            FenceError::Busy => {
                self.count("busy");
                busy(&self.claim.key)
            }
            e @ FenceError::Unavailable(_) => {
                self.count("store_error");
                tracing::error!(error = %e, key = %self.claim.key, "fence store failed");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "fence_store_unavailable",
                    e.to_string(),
                )
                .into_hyper()
            }
        }
    }

    /// Counts and logs a decision; `Err` is the refusal to answer.
    fn decided(&self, decision: &Decision) -> Result<(), Box<Response<ProxyBody>>> {
        let claim = &self.claim;
        match *decision {
            Decision::Advanced => {
                self.gw
                    .metrics
                    .token_advances
                    .with_label_values(&[self.group.as_str()])
                    .inc();
                tracing::debug!(key = %claim.key, token = claim.token, "fence advanced");
                Ok(())
            }
            Decision::Same | Decision::Shared => Ok(()),
            Decision::Stale { highest } => {
                self.count("stale");
                tracing::warn!(
                    key = %claim.key, token = claim.token, highest_seen = highest,
                    lease_tag = %claim.lease, kind = self.kind, "stale fencing token rejected"
                );
                Err(Box::new(stale(claim, highest).into_hyper()))
            }
            Decision::StaleSeq { last } => {
                let seq = self.seq.unwrap_or(0);
                self.count("stale_sequence");
                tracing::warn!(
                    key = %claim.key, token = claim.token, seq, last_seq = last,
                    lease_tag = %claim.lease, kind = self.kind,
                    "delayed or duplicated write of a lease rejected (sequence below one accepted)"
                );
                Err(Box::new(
                    ApiError::new(
                        StatusCode::CONFLICT,
                        "stale_sequence",
                        format!(
                            "write {seq} of this lease arrived after write {last} was accepted: a delayed or duplicated request"
                        ),
                    )
                    .with("key", claim.key.as_str())
                    .with("token", claim.token)
                    .with("seq", seq)
                    .with("last_seq", last)
                    .into_hyper(),
                ))
            }
            Decision::DuplicateSeq { seq } => {
                self.count("duplicate_sequence");
                tracing::warn!(
                    key = %claim.key, token = claim.token, seq, lease_tag = %claim.lease,
                    kind = self.kind, "second request with an accepted sequence number refused"
                );
                Err(Box::new(
                    ApiError::new(
                        StatusCode::CONFLICT,
                        "duplicate_sequence",
                        format!(
                            "write {seq} of this lease was already accepted; a request is applied once"
                        ),
                    )
                    .with("key", claim.key.as_str())
                    .with("token", claim.token)
                    .with("seq", seq)
                    .into_hyper(),
                ))
            }
        }
    }
}

fn busy(key: &str) -> Response<ProxyBody> {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "fence_busy",
        "timed out waiting for the previous request on this key",
    )
    .with("key", key)
    .into_hyper()
}

pub(super) fn stale(claim: &Claim, highest: u64) -> ApiError {
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

/// The storage's answer, as the gateway passes it on: without
/// [`crate::error::REFUSAL_HEADER`], which only fencer's own refusals may
/// carry — a storage (or whoever answers in its place) must not make its
/// answer look like the gateway's refusal to the application's client.
pub(super) fn storage_answer(mut resp: Response<Incoming>) -> Response<ProxyBody> {
    resp.headers_mut().remove(crate::error::REFUSAL_HEADER);
    resp.map(stream)
}
