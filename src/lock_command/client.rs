//! The two lock API calls `fencer lock` makes — `hold` and `release` — over
//! one fresh HTTP/1.1 connection each, TCP or a unix socket.
//!
//! A fresh connection per call because the hold's connection *is* the
//! lease (the sidecar releases when it closes) and must not be shared with
//! anything else; the release then needs a connection of its own.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde_json::Value;
use tokio::task::AbortHandle;

use super::args::ApiAddr;
use super::exit::LockCmdError;

/// Bound on connecting to the (local) sidecar.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on an answer that does not wait for a key (release, the rest of
/// an error body, the hold's first line after its headers).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// An error body larger than this is not the sidecar's JSON error.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// The sidecar's lock API at one address.
#[derive(Debug, Clone)]
pub struct Api {
    addr: ApiAddr,
}

/// One open HTTP connection; its task is aborted (the socket closed) when
/// this is dropped, so the connection never outlives its owner.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
    task: AbortHandle,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An answered request: its status and streaming body, with the
/// connection it arrived on (dropping both closes the socket).
pub struct Answer {
    pub status: u16,
    pub body: Incoming,
    pub conn: Conn,
}

impl Api {
    pub fn new(addr: ApiAddr) -> Api {
        Api { addr }
    }

    fn unreachable(&self, reason: impl ToString) -> LockCmdError {
        LockCmdError::Unreachable {
            api: self.addr.to_string(),
            reason: reason.to_string(),
        }
    }

    async fn connect(&self) -> Result<Conn, LockCmdError> {
        let connect = async {
            match &self.addr {
                ApiAddr::Tcp(authority) => {
                    let stream = tokio::net::TcpStream::connect(authority).await?;
                    stream.set_nodelay(true)?;
                    handshake(stream).await
                }
                ApiAddr::Unix(path) => {
                    handshake(tokio::net::UnixStream::connect(path).await?).await
                }
            }
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(self.unreachable(e)),
            Err(_) => Err(self.unreachable(format!(
                "no connection within {}s",
                CONNECT_TIMEOUT.as_secs()
            ))),
        }
    }

    /// POSTs `body` to `/v1/locks/{key}/{action}`; the answer's headers
    /// must arrive within `within`.
    async fn post(
        &self,
        key: &str,
        action: &str,
        body: &Value,
        within: Duration,
    ) -> Result<Answer, LockCmdError> {
        let mut conn = self.connect().await?;
        let host = match &self.addr {
            ApiAddr::Tcp(authority) => authority.as_str(),
            ApiAddr::Unix(_) => "localhost",
        };
        let path = format!(
            "/v1/locks/{}/{action}",
            utf8_percent_encode(key, NON_ALPHANUMERIC)
        );
        let req = hyper::Request::post(path)
            .header(hyper::header::HOST, host)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| LockCmdError::Protocol(e.to_string()))?;
        let resp = match tokio::time::timeout(within, conn.sender.send_request(req)).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => return Err(self.unreachable(e)),
            Err(_) => {
                return Err(self.unreachable(format!(
                    "no answer to {action} within {}s",
                    within.as_secs()
                )))
            }
        };
        Ok(Answer {
            status: resp.status().as_u16(),
            body: resp.into_body(),
            conn,
        })
    }

    /// `POST /v1/locks/{key}/hold`: 200 starts the NDJSON stream (returned
    /// unread); any other status is turned into its error here.
    pub async fn hold(
        &self,
        key: &str,
        body: &Value,
        within: Duration,
        wait: &str,
    ) -> Result<Answer, LockCmdError> {
        let answer = self.post(key, "hold", body, within).await?;
        if answer.status == 200 {
            return Ok(answer);
        }
        Err(refusal(answer, key, wait).await)
    }

    /// `POST /v1/locks/{key}/release`: `Ok(true)` if released, `Ok(false)`
    /// if the sidecar no longer had the lease (lost or already gone).
    pub async fn release(&self, key: &str, lease_id: &str) -> Result<bool, LockCmdError> {
        let body = serde_json::json!({ "lease_id": lease_id });
        let answer = self.post(key, "release", &body, ANSWER_TIMEOUT).await?;
        match answer.status {
            200 => Ok(true),
            404 | 409 => Ok(false),
            _ => Err(refusal(answer, key, "").await),
        }
    }
}

/// The typed error for a non-200 answer, from its JSON error body.
async fn refusal(answer: Answer, key: &str, wait: &str) -> LockCmdError {
    let status = answer.status;
    let body = read_bounded(answer.body).await;
    let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let code = json["error"].as_str().unwrap_or("").to_owned();
    let message = json["message"].as_str().unwrap_or("").to_owned();
    if code.is_empty() {
        return LockCmdError::Protocol(format!(
            "{status} without a JSON error body: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    // A key in lock-delay is not free yet either: the same exit as held.
    if status == 409 && (code == "lock_held" || code == "lock_delayed") {
        return LockCmdError::Held {
            key: key.to_owned(),
            wait: wait.to_owned(),
        };
    }
    LockCmdError::Refused {
        status,
        code,
        message,
    }
}

/// At most `MAX_ERROR_BODY` bytes of a body, within `ANSWER_TIMEOUT`;
/// whatever arrived if either bound is hit.
async fn read_bounded(mut body: Incoming) -> Vec<u8> {
    let mut out = Vec::new();
    let read = async {
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                out.extend_from_slice(&data);
                if out.len() > MAX_ERROR_BODY {
                    break;
                }
            }
        }
    };
    let _ = tokio::time::timeout(ANSWER_TIMEOUT, read).await;
    out
}

/// HTTP/1.1 over any stream; the connection runs as its own task.
async fn handshake<S>(stream: S) -> std::io::Result<Conn>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
    let task = tokio::spawn(conn).abort_handle();
    Ok(Conn { sender, task })
}
