//! The lock API's HTTP server bounds its clients: a client that never
//! finishes its request headers (slowloris) is disconnected, and others are
//! served meanwhile.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let s = Fencer::sidecar(Backend::Memory, None, &[]);
    let addr = s.api.trim_start_matches("http://").to_owned();
    let started = Instant::now();
    let slow = tokio::task::spawn_blocking(move || {
        let mut tcp = std::net::TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        tcp.write_all(b"POST /v1/locks/slow/acquire HTTP/1.1\r\nHost: x\r\n")
            .unwrap();
        // ...and never the blank line. The server must close.
        let mut buf = [0u8; 1024];
        let mut got = Vec::new();
        loop {
            match tcp.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => panic!("connection not closed by the server: {e}"),
            }
        }
        got
    });
    // Meanwhile the API serves everyone else.
    let r = s
        .post("/v1/locks/other/acquire", serde_json::json!({}))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let got = slow.await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(25),
        "closed after {waited:?}"
    );
    // hyper answers a header timeout with 408 or just closes; either way no
    // lock was taken for the slow client.
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );
    let r = s.get("/v1/locks/slow").await;
    assert_eq!(r.status, 404, "{}", r.body);
}

/// A lost lease's `held_ms` is how long it was held, frozen when it was
/// lost (at its deadline at the latest), not its age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_leases_held_ms_stops_at_its_loss() {
    let s = Fencer::sidecar(Backend::Memory, None, &[]);
    let r = s.acquire("held-ms:1", 300, 0).await;
    assert_eq!(r.status, 200);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let view = s.get("/v1/locks/held-ms:1").await;
    assert_eq!(view.body["state"], "lost", "{}", view.body);
    let held = view.body["held_ms"].as_u64().unwrap();
    assert!(
        held <= 300,
        "held_ms {held} for a 300 ms lease lost 1.2 s ago"
    );
}
