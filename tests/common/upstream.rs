//! A recording HTTP upstream for gateway and proxy tests.
//!
//! It answers every request with `{"bytes": <body length>}` after an
//! optional delay (`x-delay-ms` header), and records when each request
//! arrived and finished, with the token number its `Fencing-Token` carried.

use std::convert::Infallible;
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
}

pub struct Recorder {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recorder {
    pub async fn start() -> Recorder {
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
                            let delay = req
                                .headers()
                                .get("x-delay-ms")
                                .and_then(|v| v.to_str().ok())
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(0);
                            let mut body = req.into_body();
                            let mut bytes = 0u64;
                            while let Some(frame) = body.frame().await {
                                if let Ok(data) = frame.unwrap().into_data() {
                                    bytes += data.len() as u64;
                                }
                            }
                            tokio::time::sleep(Duration::from_millis(delay)).await;
                            seen.lock().unwrap().push(Seen {
                                path,
                                token,
                                seq,
                                arrived,
                                finished: Instant::now(),
                                bytes,
                            });
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
                                "{{\"bytes\":{bytes}}}"
                            )))))
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
