//! Connections cannot hold a listener's descriptors for free (issue 27
//! item 1): a connection that never sends a byte (or only the h2 preface)
//! is closed after `http.first_byte_timeout_ms`, one with no request in
//! flight after `http.idle_timeout_ms` — but never one whose request is
//! still running — and a process out of file descriptors keeps answering:
//! it sheds connections that have not spoken and refuses the rest at once.
//! Against real `fencer` processes (sidecar, gateway, demo storage).

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::upstream::Recorder;
use common::{Backend, Fencer};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// The h2 connection preface and an empty SETTINGS frame: what an h2c
/// prior-knowledge client sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Bounds small enough for a test, far below the 10 s header timeout that
/// closes HTTP/1 connections anyway.
const FIRST_BYTE_MS: u64 = 500;
const IDLE_MS: u64 = 1000;
/// Long enough on a loaded 2-core machine, far below "never".
const CLOSE_WITHIN: Duration = Duration::from_secs(6);

fn bounds() -> Vec<(&'static str, String)> {
    vec![
        ("http.first_byte_timeout_ms", FIRST_BYTE_MS.to_string()),
        ("http.idle_timeout_ms", IDLE_MS.to_string()),
    ]
}

fn with<'a>(
    extra: &'a [(&'static str, String)],
    more: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut v: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
    v.extend_from_slice(more);
    v
}

fn addr(url: &str) -> String {
    url.trim_start_matches("http://").to_owned()
}

/// Reads (and discards) until the server closes; the time that took, or
/// `None` if the connection was still open after `limit`.
async fn closed_after<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    limit: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(limit.saturating_sub(start.elapsed()), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_after_the_first_byte_bound_on_every_listener() {
    let b = bounds();
    let socket_dir = tempfile::tempdir().unwrap();
    let socket = socket_dir.path().join("api.sock");
    let socket_s = socket.to_string_lossy().into_owned();
    let upstream = Recorder::start().await;
    let dapr_grpc = format!("127.0.0.1:{}", common::free_port());
    let sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &with(
            &b,
            &[
                ("sidecar.listen_unix", socket_s.as_str()),
                ("sidecar.dapr_grpc_listen", dapr_grpc.as_str()),
            ],
        ),
    );
    let gateway = Fencer::gateway(&upstream.url(), &with(&b, &[]));
    let storage = Fencer::storage(&with(&b, &[]));

    let listeners = [
        ("sidecar api", addr(&sidecar.api)),
        ("sidecar proxy", addr(&sidecar.proxy)),
        ("sidecar admin", addr(&sidecar.admin)),
        ("sidecar dapr grpc", dapr_grpc.clone()),
        ("gateway", addr(&gateway.api)),
        ("gateway admin", addr(&gateway.admin)),
        ("storage", addr(&storage.api)),
    ];
    let mut checks = Vec::new();
    for (name, a) in &listeners {
        for h2 in [false, true] {
            let (name, a) = (*name, a.clone());
            checks.push(tokio::spawn(async move {
                let mut s = TcpStream::connect(&a).await.unwrap();
                if h2 {
                    s.write_all(H2_PREFACE).await.unwrap();
                }
                (name, h2, closed_after(&mut s, CLOSE_WITHIN).await)
            }));
        }
    }
    checks.push(tokio::spawn(async move {
        let mut s = UnixStream::connect(&socket).await.unwrap();
        (
            "sidecar api (unix socket)",
            false,
            closed_after(&mut s, CLOSE_WITHIN).await,
        )
    }));
    let mut report = Vec::new();
    for c in checks {
        let (name, h2, closed) = c.await.unwrap();
        let what = if h2 {
            "h2c preface, then silence"
        } else {
            "silent"
        };
        report.push(format!("{name} ({what}): {closed:?}"));
        let Some(after) = closed else {
            panic!(
                "{name} ({what}): still open after {CLOSE_WITHIN:?}\n{}",
                report.join("\n")
            );
        };
        // Closed by the bound, not by something else at once.
        let least = if h2 { IDLE_MS } else { FIRST_BYTE_MS };
        assert!(
            after >= Duration::from_millis(least * 8 / 10),
            "{name} ({what}) closed after {after:?}, before its bound ({least} ms)"
        );
    }
    eprintln!("{}", report.join("\n"));

    // Counted, per listener and reason; and every listener still serves.
    for (f, listeners) in [
        (
            &sidecar,
            &["api", "api_unix", "proxy", "admin", "dapr_grpc"][..],
        ),
        (&gateway, &["gateway", "admin"][..]),
    ] {
        let m = f.metrics().await;
        for l in listeners {
            let n = common::metric_sum(
                &m,
                "fencer_http_connections_closed_total",
                &[("listener", l), ("reason", "first_byte_timeout")],
            );
            assert!(n >= 1.0, "{l}: {n} first-byte closes counted");
        }
        let idle = common::metric_sum(
            &m,
            "fencer_http_connections_closed_total",
            &[("reason", "idle_timeout")],
        );
        assert!(
            idle >= 1.0,
            "h2c preface-then-silence closes counted as idle: {idle}"
        );
    }
    let m = storage.get("/healthz").await;
    assert_eq!(m.status, 200);
    let r = sidecar.acquire("after", 5_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let g = common::send(
        &gateway.http,
        "GET",
        &format!("{}/x", gateway.api),
        &[],
        None,
    )
    .await;
    assert_eq!(g.status, 200, "{}", g.body);
}

/// One HTTP/1.1 request on `s`; returns the status and the JSON body.
async fn h1_request(s: &mut TcpStream, method: &str, path: &str, body: &str) -> (u16, Value) {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before the response: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        let Some(head_end) = text.find("\r\n\r\n") else {
            continue;
        };
        let len: usize = text[..head_end]
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().unwrap())
            })
            .expect("content-length");
        if got.len() >= head_end + 4 + len {
            let status = text[9..12].parse().unwrap();
            let body = serde_json::from_slice(&got[head_end + 4..head_end + 4 + len]).unwrap();
            return (status, body);
        }
    }
}

type H2Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// An h2c (prior knowledge) connection; the handle resolves when the
/// server has closed it.
async fn h2_connect(a: &str) -> (H2Sender, tokio::task::JoinHandle<()>) {
    let s = TcpStream::connect(a).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s))
            .await
            .unwrap();
    (
        sender,
        tokio::spawn(async move {
            let _ = conn.await;
        }),
    )
}

async fn h2_request(
    sender: &mut H2Sender,
    a: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, Value) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{a}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = sender.send_request(req).await.expect("h2 request failed");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_close_after_the_idle_bound_and_requests_in_flight_are_never_cut() {
    let b = bounds();
    let sidecar = Fencer::sidecar(Backend::Memory, None, &with(&b, &[]));
    let api = addr(&sidecar.api);

    // Idle keep-alive, HTTP/1 and h2: closed after the idle bound (the
    // 10 s header timeout would close the HTTP/1 one much later).
    let idle_h1 = {
        let api = api.clone();
        tokio::spawn(async move {
            let mut s = TcpStream::connect(&api).await.unwrap();
            let (status, _) = h1_request(&mut s, "GET", "/v1/locks", "").await;
            assert_eq!(status, 200);
            closed_after(&mut s, CLOSE_WITHIN).await
        })
    };
    let idle_h2 = {
        let api = api.clone();
        tokio::spawn(async move {
            let (mut sender, closed) = h2_connect(&api).await;
            let (status, _) = h2_request(&mut sender, &api, "GET", "/v1/locks", "").await;
            assert_eq!(status, 200);
            let start = Instant::now();
            tokio::time::timeout(CLOSE_WITHIN, closed)
                .await
                .ok()
                .map(|_| start.elapsed())
        })
    };

    // Requests in flight far longer than the idle bound: blocking acquires
    // (HTTP/1 and h2) that wait 3 s for keys held by someone else, and a
    // hold stream.
    let held1 = sidecar.acquire("busy-1", 20_000, 0).await;
    let held2 = sidecar.acquire("busy-2", 20_000, 0).await;
    assert_eq!((held1.status, held2.status), (200, 200));
    let wait = json!({"ttl_ms": 5000, "wait_ms": 20_000}).to_string();
    let waiting_h1 = {
        let (api, wait) = (api.clone(), wait.clone());
        tokio::spawn(async move {
            let mut s = TcpStream::connect(&api).await.unwrap();
            h1_request(&mut s, "POST", "/v1/locks/busy-1/acquire", &wait).await
        })
    };
    let waiting_h2 = {
        let (api, wait) = (api.clone(), wait.clone());
        tokio::spawn(async move {
            let (mut sender, _closed) = h2_connect(&api).await;
            h2_request(&mut sender, &api, "POST", "/v1/locks/busy-2/acquire", &wait).await
        })
    };
    let mut hold = TcpStream::connect(&api).await.unwrap();
    let body = json!({"ttl_ms": 2000}).to_string();
    let req = format!(
        "POST /v1/locks/held/hold HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    hold.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("\"acquired\"") {
        let n = tokio::time::timeout(Duration::from_secs(5), hold.read(&mut buf))
            .await
            .expect("no acquired line")
            .unwrap();
        assert!(
            n > 0,
            "hold stream ended: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    // Returns the stream: dropping it would end the hold.
    let hold_reader = tokio::spawn(async move {
        let closed = closed_after(&mut hold, Duration::from_millis(3 * IDLE_MS + 500)).await;
        (closed, hold)
    });

    tokio::time::sleep(Duration::from_millis(3 * IDLE_MS)).await;
    let released_at = Instant::now();
    for (key, held) in [("busy-1", &held1), ("busy-2", &held2)] {
        let r = sidecar.release(key, &held.lease()).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let (s1, b1) = waiting_h1.await.unwrap();
    let (s2, b2) = waiting_h2.await.unwrap();
    assert_eq!(s1, 200, "HTTP/1 blocking acquire: {b1}");
    assert_eq!(s2, 200, "h2 blocking acquire: {b2}");
    assert!(released_at.elapsed() < Duration::from_secs(2));
    let (closed, hold) = hold_reader.await.unwrap();
    assert_eq!(
        closed, None,
        "the hold stream's connection was closed while it held its lease"
    );
    let h = sidecar.get("/v1/locks/held").await;
    assert_eq!(h.body["state"], "held", "{}", h.body);
    drop(hold);

    let h1 = idle_h1
        .await
        .unwrap()
        .expect("idle HTTP/1 connection still open");
    let h2 = idle_h2
        .await
        .unwrap()
        .expect("idle h2 connection still open");
    eprintln!("idle HTTP/1 closed after {h1:?}, idle h2 after {h2:?}");
    for (what, after) in [("HTTP/1", h1), ("h2", h2)] {
        assert!(
            after >= Duration::from_millis(IDLE_MS * 8 / 10),
            "idle {what} connection closed after {after:?}, before the idle bound"
        );
    }
    let m = sidecar
        .metric(
            "fencer_http_connections_closed_total",
            &[("listener", "api"), ("reason", "idle_timeout")],
        )
        .await;
    assert!(m >= 2.0, "idle closes counted: {m}");
}

/// Descriptors of the gateway under test: few enough to exhaust with a
/// handful of connections.
const NOFILE: u64 = 64;
const FLOOD: usize = 150;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_descriptor_limit_silent_connections_give_way_and_the_rest_are_refused_at_once() {
    // Default silence bounds (10 s): nothing here times out, the limit
    // alone decides.
    let upstream = Recorder::start().await;
    let gateway = Fencer::gateway_with_nofile(
        &upstream.url(),
        &[("log.level", "fencer=debug,info")],
        NOFILE,
    );
    let ga = addr(&gateway.api);
    // A fresh connection for every request: a pooled one would hide the
    // accept path.
    let fresh = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    // The gateway's own pooled connection to the storage is open before
    // the flood (a gateway in service has one).
    let warm = common::send(&fresh(), "GET", &format!("{}/warm", gateway.api), &[], None).await;
    assert_eq!(warm.status, 200, "{}", warm.body);

    // More silent connections than the gateway has descriptors.
    let mut silent = Vec::new();
    for _ in 0..FLOOD {
        silent.push(TcpStream::connect(&ga).await.unwrap());
    }
    // A connection silent for less than 250 ms is not shed (it may have
    // spoken, unread yet): a flood's sockets are older than that.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start = Instant::now();
    let r = fresh()
        .get(format!("{}/during-flood", gateway.api))
        .send()
        .await;
    let took = start.elapsed();
    let r = r.unwrap_or_else(|e| {
        panic!("no answer with {FLOOD} silent connections open after {took:?}: {e}")
    });
    assert_eq!(r.status().as_u16(), 200);
    eprintln!("answered in {took:?} with {FLOOD} silent connections against {NOFILE} descriptors");
    // The oldest silent connection gave way to the request; the flood's
    // youngest were refused as they came (too young to shed).
    let mut gave_way = Vec::new();
    for s in &mut silent {
        gave_way.push(closed_after(s, Duration::from_millis(1)).await.is_some());
    }
    assert!(gave_way[0], "the oldest silent connection is still open");
    let gave_way = gave_way.iter().filter(|c| **c).count();
    drop(silent);

    // Now every descriptor goes to connections that have spoken (one byte
    // each: nothing to shed). A new client is refused at once, not left
    // hanging until one of them ends.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut talking = Vec::new();
    for _ in 0..FLOOD {
        let mut s = TcpStream::connect(&ga).await.unwrap();
        s.write_all(b"G").await.unwrap();
        talking.push(s);
    }
    let mut probe = TcpStream::connect(&ga).await.unwrap();
    let refused = closed_after(&mut probe, Duration::from_secs(3)).await;
    assert!(
        refused.is_some(),
        "a client beyond the descriptor limit was left hanging instead of being refused\n{}",
        gateway.logs()
    );
    eprintln!("refused after {refused:?}");
    drop(talking);

    // Everything works again, and the metrics tell what happened.
    let start = Instant::now();
    loop {
        if let Ok(r) = fresh().get(format!("{}/after", gateway.api)).send().await {
            assert_eq!(r.status().as_u16(), 200);
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the gateway did not recover"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = gateway.metrics().await;
    let shed_n = common::metric_sum(
        &m,
        "fencer_http_connections_closed_total",
        &[("listener", "gateway"), ("reason", "shed")],
    );
    let refused_n = common::metric_sum(
        &m,
        "fencer_http_connections_refused_total",
        &[("listener", "gateway"), ("reason", "fd_limit")],
    );
    eprintln!("shed {shed_n}, refused {refused_n}");
    assert!(shed_n >= 1.0, "shed connections counted: {shed_n}");
    assert!(
        shed_n + refused_n >= gave_way as f64,
        "{gave_way} connections closed, {shed_n} + {refused_n} counted"
    );
    assert!(refused_n >= 1.0, "refused connections counted: {refused_n}");
    assert!(
        gateway
            .logs_with("out of file descriptors")
            .contains("out of file descriptors"),
        "no warning logged"
    );
}
