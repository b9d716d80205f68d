//! `POST <prefix><key>` with `Fencing-Token`: a sidecar registers a new
//! token before its holder reads anything, so no earlier holder can write
//! after that (PITFALLS 2).
//!
//! Like a fenced forward, the admission runs in a task of its own: a sidecar
//! that gives up (its pre-registration timeout) must not leave a check
//! half-done behind it.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::time::Instant;
use tracing::Instrument;

use super::fence_store::{Decision, FenceError};
use super::fenced::stale;
use super::state::{json_ok, Gateway, TOKEN_HEADER};
use crate::error::ApiError;
use crate::proxy::ProxyBody;

pub(super) async fn handle(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<ProxyBody> {
    if req.method() != Method::POST {
        return ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "use POST",
        )
        .into_hyper();
    }
    let raw_key = &req.uri().path()[gw.fence_prefix.len()..];
    let key = match percent_encoding::percent_decode_str(raw_key).decode_utf8() {
        Ok(k) if !k.is_empty() => k.into_owned(),
        _ => return ApiError::invalid("key", "bad key in path").into_hyper(),
    };
    if !gw.enforce {
        gw.count("none", "preregister", "unenforced");
        return json_ok(json!({"key": key, "advanced": false, "enforced": false}));
    }
    if !req.headers().contains_key(TOKEN_HEADER) {
        gw.count("none", "preregister", "missing_token");
        return ApiError::new(
            StatusCode::PRECONDITION_REQUIRED,
            "fencing_token_required",
            "pre-registration needs a Fencing-Token header",
        )
        .into_hyper();
    }
    let claim = match gw.verify_signature(&req) {
        Ok(c) if c.key == key => c,
        Ok(c) => {
            gw.count("none", "preregister", "key_mismatch");
            return ApiError::new(
                StatusCode::FORBIDDEN,
                "invalid_fencing_token",
                format!("the token is for key `{}`, not `{key}`", c.key),
            )
            .into_hyper();
        }
        Err((result, err)) => {
            gw.count("none", "preregister", result);
            return err.into_hyper();
        }
    };
    crate::telemetry::spans::lock(&claim.key, Some(claim.token));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tracker = gw.tasks.clone();
    tracker.spawn(async move {
        let group = gw.metrics.group(&claim.key);
        let deadline = Instant::now() + gw.serialize_timeout;
        let resp = match gw.keys.turn(&claim.key, deadline).await {
            None => Err(FenceError::Busy),
            Some(turn) => {
                let r = gw
                    .store
                    .admit(&claim.key, super::fence_store::Presented::new(claim.token, &claim.lease, None, claim.mode), None, deadline)
                    .await;
                drop(turn);
                r
            }
        };
        if let Ok(a) = &resp {
            super::fence_store::jump_alarm(&gw.metrics, &group, &claim, a);
            if a.decision == Decision::Advanced {
                gw.metrics
                    .token_advances
                    .with_label_values(&[group.as_str()])
                    .inc();
            }
        }
        let resp = resp.map(|a| a.decision);
        let resp = match resp {
            Ok(Decision::Advanced) | Ok(Decision::Same) | Ok(Decision::Shared) => {
                gw.count(&group, "preregister", "accepted");
                json_ok(
                    json!({"key": claim.key, "token": claim.token, "highest_seen": claim.token, "advanced": true}),
                )
            }
            Ok(Decision::Stale { highest }) => {
                gw.count(&group, "preregister", "stale");
                tracing::warn!(key = %claim.key, token = claim.token, highest_seen = highest,
                    "pre-registration of a token below the gateway's mark");
                stale(&claim, highest).into_hyper()
            }
            Ok(other) => {
                // Pre-registration carries no sequence: cannot happen.
                gw.count(&group, "preregister", "stale");
                ApiError::new(
                    StatusCode::CONFLICT,
                    "stale_fencing_token",
                    format!("{other:?}"),
                )
                .into_hyper()
            }
            Err(FenceError::Busy) => {
                gw.count(&group, "preregister", "busy");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "fence_busy",
                    "timed out waiting for the previous request on this key",
                )
                .with("key", claim.key.as_str())
                .into_hyper()
            }
            Err(e) => {
                gw.count(&group, "preregister", "store_error");
                tracing::error!(error = %e, key = %claim.key, "fence store failed");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "fence_store_unavailable",
                    e.to_string(),
                )
                .into_hyper()
            }
        };
        let _ = tx.send(resp);
    }
    .in_current_span());
    rx.await.unwrap_or_else(|_| {
        ApiError::internal("pre-registration ended without an answer").into_hyper()
    })
}
