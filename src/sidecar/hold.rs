//! Hold mode: a lock bound to an open connection.
//!
//! `POST /v1/locks/{key}/hold` answers with newline-delimited JSON: a first
//! line with the lease, heartbeat lines, and a last line if the lease is
//! lost or the sidecar shuts down. The sidecar renews the lease while the
//! connection is open; when the client goes away (including a process that
//! died: the kernel closes its socket) the lock is released at once — the
//! ZooKeeper ephemeral-node behaviour for any language that reads HTTP.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use super::leases::LeaseView;
use super::locks::LockManager;
use crate::lock::{LeaseId, LockKey};

fn line(v: Value) -> Result<Bytes, Infallible> {
    let mut s = v.to_string();
    s.push('\n');
    Ok(Bytes::from(s))
}

/// The streaming body of a hold; owns the lease until the stream ends.
pub fn stream(
    locks: Arc<LockManager>,
    view: LeaseView,
    heartbeat: Duration,
    shutdown: CancellationToken,
) -> Body {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(4);
    let mut lost = locks.lost_events();
    let lease = LeaseId::parse(&view.lease_id).expect("our own lease id");
    // A read lease is tracked under a reader key of its own.
    let key = locks.lease_key(
        &LockKey::parse(&view.key).expect("key of our own lease"),
        &lease,
    );
    let gauge = locks.metrics().hold_streams.clone();
    gauge.inc();
    tokio::spawn(async move {
        // Re-read at the moment of sending: "acquired" must carry the time
        // left now, and a lease that ran out meanwhile is reported lost
        // (PITFALLS 12).
        let now_view = match locks.get(&key) {
            Ok(v) if v.lease_id == lease.as_str() && v.state == "held" => Some(v),
            _ => None,
        };
        let mut first = match now_view {
            Some(v) => {
                let mut first = serde_json::to_value(&v).expect("lease view serializes");
                first["type"] = json!("acquired");
                first
            }
            None => json!({"type": "lost", "reason": "deadline", "key": key.as_str()}),
        };
        let lost_at_start = first["type"] == "lost";
        let _ = tx.send(line(first.take())).await;
        if lost_at_start {
            gauge.dec();
            return;
        }
        let mut beat = tokio::time::interval(heartbeat);
        beat.tick().await;
        let end = loop {
            tokio::select! {
                _ = tx.closed() => break "closed",
                _ = beat.tick() => {
                    match locks.get(&key) {
                        Ok(v) if v.lease_id == lease.as_str() && v.state == "held" => {
                            let hb = json!({"type": "heartbeat", "remaining_ms": v.remaining_ms, "token": v.token});
                            if tx.send(line(hb)).await.is_err() {
                                break "closed";
                            }
                        }
                        Ok(v) if v.lease_id == lease.as_str() => {
                            let reason = v.lost_reason.unwrap_or("deadline");
                            let _ = tx.send(line(json!({"type": "lost", "reason": reason, "key": key.as_str()}))).await;
                            break "lost";
                        }
                        _ => {
                            let _ = tx.send(line(json!({"type": "lost", "reason": "gone", "key": key.as_str()}))).await;
                            break "lost";
                        }
                    }
                }
                event = lost.recv() => match event {
                    Ok(l) if l.lease_id == lease => {
                        let _ = tx.send(line(json!({"type": "lost", "reason": l.reason.as_str(), "key": key.as_str()}))).await;
                        break "lost";
                    }
                    Err(broadcast::error::RecvError::Closed) => break "lost",
                    _ => {}
                },
                _ = shutdown.cancelled() => {
                    let _ = tx.send(line(json!({"type": "released", "reason": "shutdown", "key": key.as_str()}))).await;
                    break "shutdown";
                }
            }
        };
        gauge.dec();
        if end == "closed" {
            // The client is gone: free the key now, not at the TTL.
            let released = locks.release(key.clone(), lease.clone()).await.is_ok();
            tracing::info!(key = %key, lease_tag = %lease.tag(), released, "hold connection closed");
        }
    });
    Body::from_stream(tokio_stream_from(rx))
}

fn tokio_stream_from(
    mut rx: mpsc::Receiver<Result<Bytes, Infallible>>,
) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
