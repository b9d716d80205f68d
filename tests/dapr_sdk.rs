//! fencer as a Dapr drop-in, tried with Dapr's official SDKs from the
//! package registries (tests/dapr_sdk/: `@dapr/dapr` over HTTP and gRPC,
//! Python's `dapr` over gRPC; tests/run.sh installs them) against `fencer
//! dev`: each SDK starts (its sidecar check: `/v1.0/metadata`, gRPC
//! `GetMetadata`, `/v1.0/healthz/outbound`), acquires, is refused for
//! another owner, unlocks with each status, and writes through the egress
//! proxy with the lease it holds (a stale one refused at the proxy and the
//! gateway). And over raw HTTP/2: every Dapr method fencer does not serve
//! answers UNIMPLEMENTED at once; bounds and metadata of the gRPC calls.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencer::sidecar::dapr_grpc::messages::*;
use http_body_util::BodyExt;
use prost::Message;
use serde_json::Value;

use common::dev::Dev;

fn sdk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/dapr_sdk")
}

fn port_of(url: &str) -> &str {
    url.rsplit(':').next().unwrap()
}

/// Runs one SDK script against `dev`; its output when it passed.
fn run_sdk(dev: &Dev, program: &str, args: &[&str]) -> String {
    let started = Instant::now();
    let out = Command::new(program)
        .args(args)
        .current_dir(sdk_dir())
        .env("FENCER_API", &dev.api)
        .env("FENCER_PROXY", &dev.proxy)
        .env("FENCER_GATEWAY", &dev.gateway)
        .env("DAPR_RUNTIME_HOST", "127.0.0.1")
        .env("DAPR_HTTP_PORT", port_of(&dev.api))
        .env("DAPR_GRPC_PORT", port_of(&dev.dapr_grpc))
        .env("DAPR_HEALTH_TIMEOUT", "10")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e} (tests/run.sh installs it)"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.lines().any(|l| l.trim() == "ok"),
        "{program} {args:?} failed:\n{text}"
    );
    eprintln!("{program} {args:?}: {:?}", started.elapsed());
    text
}

fn node_sdk_installed() {
    assert!(
        sdk_dir()
            .join("node_modules/@dapr/dapr/package.json")
            .exists(),
        "@dapr/dapr is not installed: (cd tests/dapr_sdk && npm ci) — tests/run.sh does"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapr_node_sdk_over_http_and_grpc_locks_unlocks_and_writes_with_its_lease() {
    node_sdk_installed();
    let dev = Dev::start();
    run_sdk(&dev, "node", &["node_sdk.js", "http"]);
    run_sdk(&dev, "node", &["node_sdk.js", "grpc"]);
    let metrics = dev.metrics().await;
    for line in [
        r#"fencer_dapr_requests_total{op="lock",protocol="http",result="success"} 2"#,
        r#"fencer_dapr_requests_total{op="lock",protocol="grpc",result="success"} 2"#,
        r#"fencer_dapr_requests_total{op="lock",protocol="grpc",result="held"} 1"#,
        r#"fencer_dapr_requests_total{op="unlock",protocol="grpc",result="other_owner"} 1"#,
        r#"fencer_dapr_requests_total{op="lease",protocol="http",result="not_found"} 4"#,
    ] {
        assert!(metrics.contains(line), "no {line} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapr_python_sdk_over_grpc_locks_unlocks_and_writes_with_its_lease() {
    let dev = Dev::start();
    run_sdk(&dev, "python3", &["python_sdk.py"]);
}

/// One gRPC call over a fresh HTTP/2 connection: the `grpc-status` (from
/// the trailers, or the headers of a trailers-only answer), the response
/// headers, and the message.
struct Answer {
    status: Option<String>,
    headers: http::HeaderMap,
    message: Bytes,
}

async fn grpc(addr: &str, method: &str, message: &[u8], timeout: Option<&str>) -> Answer {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut framed = vec![0u8];
    framed.extend((message.len() as u32).to_be_bytes());
    framed.extend(message);
    let mut req = http::Request::post(format!("http://{addr}{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = timeout {
        req = req.header("grpc-timeout", t);
    }
    let req = req
        .body(http_body_util::Full::new(Bytes::from(framed)))
        .unwrap();
    let call = async {
        let resp = send.send_request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap_or_default();
        let bytes = collected.to_bytes();
        let status = trailers
            .get("grpc-status")
            .or(parts.headers.get("grpc-status"))
            .map(|v| v.to_str().unwrap().to_owned());
        Answer {
            status,
            headers: parts.headers,
            message: if bytes.len() >= 5 {
                bytes.slice(5..)
            } else {
                bytes
            },
        }
    };
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .unwrap_or_else(|_| panic!("{method}: no answer within 5 s"))
}

const DAPR: &str = "/dapr.proto.runtime.v1.Dapr/";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapr_methods_fencer_does_not_serve_answer_unimplemented_at_once() {
    let dev = Dev::start();
    for method in [
        format!("{DAPR}GetState"),
        format!("{DAPR}InvokeService"),
        format!("{DAPR}SubscribeTopicEventsAlpha1"),
        format!("{DAPR}TryLockAlpha2"),
        "/dapr.proto.runtime.v1.AppCallback/OnInvoke".to_owned(),
        "/grpc.health.v1.Health/Check".to_owned(),
        "/".to_owned(),
    ] {
        let started = Instant::now();
        let a = grpc(&dev.dapr_grpc, &method, b"\x0a\x03abc", None).await;
        assert_eq!(a.status.as_deref(), Some("12"), "{method}: UNIMPLEMENTED");
        assert!(started.elapsed() < Duration::from_secs(1), "{method}: slow");
    }
    assert!(dev.metrics().await.contains(
        r#"fencer_dapr_requests_total{op="other",protocol="grpc",result="unimplemented"} 7"#
    ));
}

async fn post_json(url: &str, body: &'static str) -> Value {
    let r = reqwest::Client::new().post(url).body(body).send().await;
    r.unwrap().json().await.unwrap()
}

fn try_lock(resource: &str, owner: &str, expiry: i32) -> Vec<u8> {
    TryLockRequest {
        store_name: "lockstore".into(),
        resource_id: resource.into(),
        lock_owner: owner.into(),
        expiry_in_seconds: expiry,
    }
    .encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_lock_calls_answer_the_lease_as_metadata_and_keep_their_bounds() {
    let dev = Dev::start();
    let lock = format!("{DAPR}TryLockAlpha1");
    let a = grpc(&dev.dapr_grpc, &lock, &try_lock("grpc:1", "o1", 30), None).await;
    assert_eq!(a.status.as_deref(), Some("0"));
    assert!(TryLockResponse::decode(a.message).unwrap().success);
    let lease = a.headers["fencing-lease"].to_str().unwrap().to_owned();
    assert!(a.headers.contains_key("fencing-token"));
    assert_eq!(a.headers["fencing-key"], "grpc:1");
    // The same lease as the HTTP look-up names.
    let view = post_json(
        &format!("{}/v1/dapr/lockstore/lease", dev.api),
        r#"{"resourceId":"grpc:1","lockOwner":"o1"}"#,
    )
    .await;
    assert_eq!(view["lease_id"], lease.as_str());

    // The shared checks, as INVALID_ARGUMENT.
    for (body, what) in [
        (try_lock("grpc:2", "o1", 0), "expiry 0"),
        (try_lock("grpc:2", "o1", 100_000), "expiry too long"),
        (try_lock("", "o1", 10), "empty resource"),
        (try_lock("grpc:2", &"o".repeat(300), 10), "long owner"),
    ] {
        let a = grpc(&dev.dapr_grpc, &lock, &body, None).await;
        assert_eq!(a.status.as_deref(), Some("3"), "{what}");
    }
    // Not protobuf: gRPC's INTERNAL for a message that does not decode.
    let a = grpc(&dev.dapr_grpc, &lock, b"\xff\xff", None).await;
    assert_eq!(a.status.as_deref(), Some("13"));
    let unknown_store = TryLockRequest {
        store_name: "nope".into(),
        resource_id: "r".into(),
        lock_owner: "o".into(),
        expiry_in_seconds: 5,
    };
    let a = grpc(&dev.dapr_grpc, &lock, &unknown_store.encode_to_vec(), None).await;
    assert_eq!(a.status.as_deref(), Some("3"));
    // A message over the bound: refused without being read whole.
    let huge = try_lock(&"k".repeat(64 * 1024), "o", 5);
    let a = grpc(&dev.dapr_grpc, &lock, &huge, None).await;
    assert_eq!(a.status.as_deref(), Some("11"), "OUT_OF_RANGE");
    // An already expired deadline: DEADLINE_EXCEEDED, not an acquire.
    let a = grpc(
        &dev.dapr_grpc,
        &lock,
        &try_lock("grpc:3", "o", 5),
        Some("0n"),
    )
    .await;
    assert_eq!(a.status.as_deref(), Some("4"), "DEADLINE_EXCEEDED");

    let unlock = |owner: &str| {
        UnlockRequest {
            store_name: "lockstore".into(),
            resource_id: "grpc:1".into(),
            lock_owner: owner.into(),
        }
        .encode_to_vec()
    };
    let path = format!("{DAPR}UnlockAlpha1");
    for (owner, status) in [("o2", 2), ("o1", 0), ("o1", 1)] {
        let a = grpc(&dev.dapr_grpc, &path, &unlock(owner), None).await;
        assert_eq!(a.status.as_deref(), Some("0"));
        assert_eq!(UnlockResponse::decode(a.message).unwrap().status, status);
    }

    let a = grpc(&dev.dapr_grpc, &format!("{DAPR}GetMetadata"), &[], None).await;
    let meta = GetMetadataResponse::decode(a.message).unwrap();
    assert_eq!(meta.registered_components.len(), 1);
    assert_eq!(meta.registered_components[0].name, "lockstore");
    assert_eq!(meta.registered_components[0].r#type, "lock.memory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapr_http_start_checks_answer_in_daprs_shape() {
    let dev = Dev::start();
    let http = reqwest::Client::new();
    let meta = http
        .get(format!("{}/v1.0/metadata", dev.api))
        .send()
        .await
        .unwrap();
    assert_eq!(meta.status(), 200);
    let meta: Value = meta.json().await.unwrap();
    assert_eq!(meta["id"], "fencer");
    assert_eq!(
        meta["components"],
        serde_json::json!([{"name": "lockstore", "type": "lock.memory", "version": "v1"}])
    );
    for path in ["/v1.0/healthz", "/v1.0/healthz/outbound"] {
        let r = http.get(format!("{}{path}", dev.api)).send().await.unwrap();
        assert_eq!(r.status(), 204, "{path}");
    }
    // The look-up is an allow-list: another owner, another store, no lock.
    let lease = |body: &'static str, store: &str| {
        http.post(format!("{}/v1/dapr/{store}/lease", dev.api))
            .body(body)
            .send()
    };
    let lock = post_json(
        &format!("{}/v1.0-alpha1/lock/lockstore", dev.api),
        r#"{"resourceId":"look:1","lockOwner":"me","expiryInSeconds":30}"#,
    )
    .await;
    assert_eq!(lock["success"], true);
    let own = lease(r#"{"resourceId":"look:1","lockOwner":"me"}"#, "lockstore")
        .await
        .unwrap();
    assert_eq!(own.status(), 200);
    for (body, store, status) in [
        (
            r#"{"resourceId":"look:1","lockOwner":"you"}"#,
            "lockstore",
            404,
        ),
        (
            r#"{"resourceId":"look:2","lockOwner":"me"}"#,
            "lockstore",
            404,
        ),
        (r#"{"resourceId":"look:1","lockOwner":"me"}"#, "other", 400),
        (
            r#"{"resourceId":"look:1","lockOwner":"me","x":1}"#,
            "lockstore",
            400,
        ),
    ] {
        let r = lease(body, store).await.unwrap();
        assert_eq!(r.status(), status, "{body} {store}");
    }
    // A Dapr lease's owner (its credential) is not shown to other clients.
    let listed: Value = reqwest::get(format!("{}/v1/locks/look:1", dev.api))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(listed.get("owner").is_none(), "{listed}");
}

#[test]
fn fencer_dev_runs_without_the_dapr_grpc_api_when_its_port_is_taken() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let (mut cmd, [_, _, _, _, admin]) = Dev::command();
    let mut child = cmd
        .env(
            "FENCER__SIDECAR__DAPR_GRPC_LISTEN",
            format!("127.0.0.1:{port}"),
        )
        .env("FENCER__LOG__LEVEL", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = format!("http://127.0.0.1:{admin}/readyz");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !common::http_ok(&ready) {
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "fencer dev did not run:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("Dapr's gRPC API is off") && text.contains("Dapr gRPC API  off"),
        "{text}"
    );
    drop(taken);
}
