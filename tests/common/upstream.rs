//! A recording HTTP upstream for gateway and proxy tests: the storage whose
//! log tells the order in which writes were *applied*.
//!
//! It answers every request with `{"bytes": <body length>}` after an
//! optional delay (`x-delay-ms` header, or a default for every request),
//! and records when each request arrived and when it was applied, with the
//! token number its `Fencing-Token` carried. Like a real storage that has
//! received a write, it applies it even if the client hangs up meanwhile:
//! the delay and the record run in a task detached from the connection.
//! With `x-reset: 1` it cuts the connection as soon as it has read the
//! request (no response at all) and still applies the write after the
//! delay: the storage behind a reset link whose write lands anyway.
//! With `x-answer-fencing-error: <code>` its answer carries
//! `Fencing-Error: <code>`: a storage posing as fencer's refusal.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub token: Option<u64>,
    /// The `Fencing-Seq` the request carried.
    pub seq: Option<u64>,
    pub arrived: Instant,
    pub finished: Instant,
    pub bytes: u64,
    /// The raw `Fencing-Token` header, if any.
    pub raw_token: Option<String>,
    /// The first 64 KiB of the body.
    pub body: Vec<u8>,
    pub method: String,
    /// Every `Fencing-*` header that reached the storage, as (lower-case
    /// name, value), in order.
    pub fencing: Vec<(String, String)>,
    /// Every `traceparent` header that reached the storage, in order.
    pub traceparents: Vec<String>,
}

pub struct Recorder {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recorder {
    pub async fn start() -> Recorder {
        Recorder::start_with_delay(0).await
    }

    /// Every request is held `delay_ms` (unless it says otherwise).
    pub async fn start_with_delay(default_delay_ms: u64) -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let seen = seen2.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let seen = seen.clone();
                        async move {
                            let arrived = Instant::now();
                            let path = req.uri().path().to_owned();
                            let method = req.method().to_string();
                            let fencing: Vec<(String, String)> = req
                                .headers()
                                .iter()
                                .filter(|(n, _)| n.as_str().starts_with("fencing-"))
                                .map(|(n, v)| {
                                    (
                                        n.as_str().to_owned(),
                                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                                    )
                                })
                                .collect();
                            let traceparents: Vec<String> = req
                                .headers()
                                .get_all("traceparent")
                                .iter()
                                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                                .collect();
                            let raw_token = req
                                .headers()
                                .get("fencing-token")
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned);
                            let token = req
                                .headers()
                                .get("fencing-token")
                                .and_then(|v| v.to_str().ok())
                                .and_then(|t| t.split('.').nth(2))
                                .and_then(|t| t.parse().ok());
                            let seq = req
                                .headers()
                                .get("fencing-seq")
                                .and_then(|v| v.to_str().ok())
                                .and_then(|v| v.parse().ok());
                            let reset = req.headers().contains_key("x-reset");
                            // A storage answering with fencer's refusal header
                            // (the gateway must strip it).
                            let forged = req.headers().get("x-answer-fencing-error").cloned();
                            let delay = req
                                .headers()
                                .get("x-delay-ms")
                                .and_then(|v| v.to_str().ok())
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(default_delay_ms);
                            let mut body = req.into_body();
                            let mut bytes = 0u64;
                            let mut kept = Vec::new();
                            while let Some(frame) = body.frame().await {
                                match frame {
                                    Ok(f) => {
                                        if let Ok(data) = f.into_data() {
                                            bytes += data.len() as u64;
                                            let room = (64 * 1024usize).saturating_sub(kept.len());
                                            kept.extend_from_slice(&data[..data.len().min(room)]);
                                        }
                                    }
                                    Err(_) => break,
                                }
                            }
                            let apply = tokio::spawn(async move {
                                tokio::time::sleep(Duration::from_millis(delay)).await;
                                seen.lock().unwrap().push(Seen {
                                    path,
                                    token,
                                    seq,
                                    arrived,
                                    finished: Instant::now(),
                                    bytes,
                                    raw_token,
                                    body: kept,
                                    method,
                                    fencing,
                                    traceparents,
                                });
                            });
                            if reset {
                                return Err("cut the connection (x-reset)");
                            }
                            let _ = apply.await;
                            let mut resp = Response::new(Full::new(Bytes::from(format!(
                                "{{\"bytes\":{bytes}}}"
                            ))));
                            if let Some(v) = forged {
                                resp.headers_mut().insert("fencing-error", v);
                            }
                            Ok::<_, &'static str>(resp)
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Recorder { addr, seen }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}
