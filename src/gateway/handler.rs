//! Where the gateway decides what a request is: every request passes
//! through [`Gateway::handle`].
//!
//! A request carrying `Fencing-Token` (any method: a fenced read advances
//! the mark too) has its path put in normal form, its token verified against
//! the key it may touch, and is then admitted and forwarded by
//! [`super::fenced`] in a task of its own. Writes without a token are
//! refused; reads without one pass unchecked.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use tokio::time::Instant;

use super::fence_store::FenceStore;
use super::key_queue::KeyQueue;
use crate::error::ApiError;
use crate::metrics::GatewayMetrics;
use crate::proxy::forward::{strip_hop_by_hop, Forwarder};
use crate::proxy::{stream, ProxyBody};
use crate::routes::Routes;
use crate::token::Keyring;

pub use crate::proxy::headers::{KEY as KEY_HEADER, SEQ as SEQ_HEADER, TOKEN as TOKEN_HEADER};

pub struct Gateway {
    pub forwarder: Forwarder,
    pub store: Arc<dyn FenceStore>,
    /// Turns per key inside this process.
    pub keys: Arc<KeyQueue>,
    pub keyring: Keyring,
    pub routes: Routes,
    pub write_methods: Vec<Method>,
    /// Reads need a token too.
    pub require_token_for_reads: bool,
    pub enforce: bool,
    pub fence_prefix: String,
    /// How long a fenced request waits for its key.
    pub serialize_timeout: Duration,
    /// The storage's time to answer (and to take the request body).
    pub upstream_timeout: Duration,
    /// After an unknown outcome, how long the key stays blocked.
    pub uncertain_hold: Duration,
    /// How long an in-flight stamp keeps other replicas off a key, were
    /// this gateway to die mid-forward: every step that can still change
    /// the storage fits in it.
    pub stamp_hold: Duration,
    pub metrics: Arc<GatewayMetrics>,
    /// The fenced forwards and pre-registrations in flight: a shutdown waits
    /// for them, so a rolling restart does not leave stamps to run out.
    pub tasks: tokio_util::task::TaskTracker,
}

impl Gateway {
    pub(super) fn count(&self, group: &str, kind: &str, result: &str) {
        self.metrics
            .requests
            .with_label_values(&[group, kind, result])
            .inc();
    }

    pub async fn handle(self: Arc<Self>, mut req: Request<Incoming>) -> Response<ProxyBody> {
        strip_hop_by_hop(req.headers_mut());
        if req.uri().path().starts_with(&self.fence_prefix) {
            return super::preregister::handle(self, req).await;
        }
        let kind = if self.write_methods.contains(req.method()) {
            "write"
        } else {
            "read"
        };
        if !self.enforce {
            self.count("none", kind, "unenforced");
            return self.forward_unfenced(req).await;
        }
        let token_unchecked = kind == "read" && crate::mutants::active("unfenced_reads");
        if token_unchecked || !req.headers().contains_key(TOKEN_HEADER) {
            if !token_unchecked && (kind == "write" || self.require_token_for_reads) {
                self.count("none", kind, "missing_token");
                return ApiError::new(
                    StatusCode::PRECONDITION_REQUIRED,
                    "fencing_token_required",
                    "this request needs a Fencing-Token header (send it through the fencer sidecar's proxy)",
                )
                .into_hyper();
            }
            self.count("none", kind, "unchecked");
            return self.forward_unfenced(req).await;
        }
        if let Err((result, err)) = self.normalize_path(&mut req) {
            self.count("none", kind, result);
            return err.into_hyper();
        }
        let claim = match self.verify(&req) {
            Ok(c) => c,
            Err((result, err)) => {
                self.count("none", kind, result);
                return err.into_hyper();
            }
        };
        let seq = match super::verify::sequence(&req) {
            Ok(s) => s,
            Err(e) => {
                self.count("none", kind, "invalid_sequence");
                return e.into_hyper();
            }
        };
        super::fenced::forward(self, req, claim, seq, kind).await
    }

    /// Forwards a request that needs no fencing (reads without a token, or
    /// everything with enforcement off): nothing to hold.
    async fn forward_unfenced(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let started = Instant::now();
        let result = self.forwarder.forward(req.map(stream)).await;
        let elapsed = started.elapsed().as_secs_f64();
        match result {
            Ok(resp) => {
                self.metrics
                    .upstream_duration
                    .with_label_values(&["ok"])
                    .observe(elapsed);
                resp.map(stream)
            }
            Err(e) => {
                self.metrics
                    .upstream_duration
                    .with_label_values(&[e.outcome()])
                    .observe(elapsed);
                tracing::warn!(error = %e, "upstream request failed");
                e.to_response()
            }
        }
    }
}

pub(super) fn json_ok(body: serde_json::Value) -> Response<ProxyBody> {
    Response::builder()
        .status(StatusCode::OK)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(crate::proxy::full(body.to_string()))
        .expect("static response parts")
}
