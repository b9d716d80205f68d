//! The lost-lease webhook: tells an operator's endpoint, asynchronously,
//! when a lease ended without a release.
//!
//! Deliveries go through a bounded queue so a slow or dead endpoint never
//! blocks lock handling; when the queue is full the event is dropped and
//! counted.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prometheus::IntCounterVec;
use serde_json::json;
use tokio::sync::mpsc;

use super::leases::Lost;

const QUEUE: usize = 1024;
const ATTEMPTS: u32 = 3;

pub struct Webhook {
    tx: mpsc::Sender<Lost>,
    counter: IntCounterVec,
}

impl Webhook {
    /// `counter` is `fencer_webhook_deliveries_total{result}`.
    pub fn start(url: String, timeout: Duration, counter: IntCounterVec) -> Webhook {
        let (tx, mut rx) = mpsc::channel::<Lost>(QUEUE);
        let c = counter.clone();
        tokio::spawn(async move {
            let client: Client<HttpConnector, Full<Bytes>> =
                Client::builder(TokioExecutor::new()).build_http();
            while let Some(lost) = rx.recv().await {
                let body = json!({
                    "event": "lease_lost",
                    "key": lost.key.as_str(),
                    // The tag, not the id: the id is the credential that
                    // renews and releases, and webhook receivers log.
                    "lease_tag": lost.lease_id.tag(),
                    "token": lost.token,
                    "owner": lost.owner,
                    "reason": lost.reason.as_str(),
                    "held_ms": lost.held_for.as_millis() as u64,
                })
                .to_string();
                let mut delivered = false;
                for attempt in 0..ATTEMPTS {
                    let req = hyper::Request::post(url.as_str())
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body.clone())))
                        .expect("static request parts");
                    match tokio::time::timeout(timeout, client.request(req)).await {
                        Ok(Ok(resp)) if resp.status().is_success() => {
                            delivered = true;
                            break;
                        }
                        other => {
                            tracing::warn!(attempt, outcome = ?other.map(|r| r.map(|x| x.status())), "lost-lease webhook failed");
                            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                        }
                    }
                }
                c.with_label_values(&[if delivered { "delivered" } else { "failed" }])
                    .inc();
            }
        });
        Webhook { tx, counter }
    }

    pub fn send(&self, lost: &Lost) {
        if self.tx.try_send(lost.clone()).is_err() {
            self.counter.with_label_values(&["dropped"]).inc();
        }
    }
}
