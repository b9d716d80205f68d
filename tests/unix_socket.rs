//! The lock API on a Unix socket (`sidecar.listen_unix`): same API as on
//! TCP, owner/group-only permissions, a stale socket from a crashed run is
//! replaced, a file of another kind is never deleted, and the socket is
//! removed on shutdown.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::process::Command;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};

/// One request over the Unix socket; returns status and JSON body.
async fn unix_post(path: &std::path::Path, uri: &str, body: &str) -> (u16, serde_json::Value) {
    let stream = tokio::net::UnixStream::connect(path).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::post(uri)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or_default())
}

#[tokio::test]
async fn lock_api_on_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    // A stale socket file, as a killed sidecar leaves behind.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let mut s = Fencer::sidecar(
        Backend::Memory,
        None,
        &[("sidecar.listen_unix", sock.to_str().unwrap())],
    );
    let meta = std::fs::metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);

    let (status, body) = unix_post(&sock, "/v1/locks/uds/acquire", r#"{"ttl_ms":5000}"#).await;
    assert_eq!(status, 200, "{body}");
    let token = body["token"].as_u64().unwrap();
    // The same lock table behind both listeners: TCP sees the lease.
    let r = s.post("/v1/locks/uds/acquire", serde_json::json!({})).await;
    assert_eq!(r.status, 409, "{}", r.body);
    let lease = body["lease_id"].as_str().unwrap();
    let (status, body) = unix_post(
        &sock,
        "/v1/locks/uds/release",
        &format!(r#"{{"lease_id":"{lease}"}}"#),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let r = s.post("/v1/locks/uds/acquire", serde_json::json!({})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.token() > token);
    // Bad input gets the JSON error shape here too.
    let (status, body) = unix_post(&sock, "/v1/locks/uds/acquire", "{not json").await;
    assert_eq!(status, 400);
    assert!(body["error"].is_string(), "{body}");

    assert_eq!(s.terminate(), Some(0));
    assert!(!sock.exists(), "socket file left behind after shutdown");
}

#[test]
fn refuses_to_replace_a_file_that_is_not_a_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("precious");
    std::fs::write(&path, "data").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .arg("sidecar")
        .env("FENCER__BACKEND__KIND", "memory")
        .env("FENCER__SIGNING__SECRET_ENV", "FENCER_TEST_SECRET")
        .env("FENCER_TEST_SECRET", SECRET)
        .env(
            "FENCER__SIDECAR__LISTEN",
            format!("127.0.0.1:{}", free_port()),
        )
        .env("FENCER__PROXY__ENABLED", "false")
        .env(
            "FENCER__ADMIN__LISTEN",
            format!("127.0.0.1:{}", free_port()),
        )
        .env("FENCER__SIDECAR__LISTEN_UNIX", &path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
}

#[test]
fn relative_socket_path_is_a_config_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .args(["check-config"])
        .env("FENCER__SIDECAR__LISTEN_UNIX", "relative.sock")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sidecar.listen_unix"));
}
