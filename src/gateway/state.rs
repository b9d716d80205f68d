//! The gateway's shared state — its stores, key queue, keyring, routes
//! and limits — and the small helpers every step of a request uses. A
//! leaf module: [`super::handler`] (what a request is), [`super::verify`]
//! (its token), [`super::fenced`] (its turn and forward) and
//! [`super::preregister`] all take a `&Gateway` without importing each
//! other's code.

use std::sync::Arc;
use std::time::Duration;

use hyper::{Method, Response, StatusCode};

use super::fence_store::FenceStore;
use super::key_queue::KeyQueue;
use crate::metrics::GatewayMetrics;
use crate::proxy::forward::Forwarder;
use crate::proxy::ProxyBody;
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
    /// The methods that are reads (`gateway.read_methods`); every other
    /// method is a write.
    pub read_methods: Vec<Method>,
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
        crate::telemetry::spans::outcome(result);
        self.metrics
            .requests
            .with_label_values(&[group, kind, result])
            .inc();
    }
}

pub(super) fn json_ok(body: serde_json::Value) -> Response<ProxyBody> {
    Response::builder()
        .status(StatusCode::OK)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(crate::proxy::full(body.to_string()))
        .expect("static response parts")
}
