//! Reading the hold stream: newline-delimited JSON lines from the sidecar
//! (`acquired`, then `heartbeat`s, then maybe `lost` or `released`), each
//! turned into an [`Event`].

use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use super::client::Conn;

/// A line longer than this is not the sidecar's: the stream is broken.
const MAX_LINE: usize = 64 * 1024;

/// The lease as the `acquired` line tells it.
#[derive(Debug, Clone)]
pub struct Lease {
    pub key: String,
    pub token: u64,
    pub lease_id: String,
    pub fencing_token: String,
    pub ttl_ms: u64,
}

/// One line of the hold stream.
#[derive(Debug)]
pub enum Event {
    Acquired(Lease),
    /// The lease is still held (sent every `sidecar.hold_heartbeat_ms`).
    Heartbeat,
    /// The sidecar lost the lease (`reason`: deadline, renew_failed, gone…).
    Lost {
        reason: String,
    },
    /// The sidecar ended the hold itself (`reason`: shutdown).
    Released {
        reason: String,
    },
}

/// The open hold: owns its connection, so dropping it closes the socket —
/// which tells the sidecar to release the lease if it still has it.
pub struct HoldStream {
    body: Incoming,
    buf: Vec<u8>,
    _conn: Conn,
}

impl HoldStream {
    pub fn new(body: Incoming, conn: Conn) -> HoldStream {
        HoldStream {
            body,
            buf: Vec::new(),
            _conn: conn,
        }
    }

    /// The next event; `Ok(None)` when the sidecar ended the stream.
    ///
    /// Cancel-safe: a frame is moved into the buffer in the same poll that
    /// yields it, so a `select!` that drops this future loses nothing.
    pub async fn next(&mut self) -> Result<Option<Event>, String> {
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return parse(&line).map(Some);
            }
            if self.buf.len() > MAX_LINE {
                return Err(format!("a line longer than {MAX_LINE} bytes"));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(e.to_string()),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

fn parse(line: &[u8]) -> Result<Event, String> {
    let v: Value = serde_json::from_slice(line).map_err(|e| {
        format!(
            "not a JSON line ({e}): {}",
            String::from_utf8_lossy(&line[..line.len().min(200)])
        )
    })?;
    let text = |field: &str| v[field].as_str().map(str::to_owned);
    let reason = || text("reason").unwrap_or_else(|| "unknown".into());
    match v["type"].as_str() {
        Some("acquired") => {
            let missing = |field: &str| format!("`acquired` line without `{field}`: {v}");
            Ok(Event::Acquired(Lease {
                key: text("key").ok_or_else(|| missing("key"))?,
                token: v["token"].as_u64().ok_or_else(|| missing("token"))?,
                lease_id: text("lease_id").ok_or_else(|| missing("lease_id"))?,
                fencing_token: text("fencing_token").ok_or_else(|| missing("fencing_token"))?,
                ttl_ms: v["ttl_ms"].as_u64().ok_or_else(|| missing("ttl_ms"))?,
            }))
        }
        Some("heartbeat") => Ok(Event::Heartbeat),
        Some("lost") => Ok(Event::Lost { reason: reason() }),
        Some("released") => Ok(Event::Released { reason: reason() }),
        _ => Err(format!("a line of unknown type: {v}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        let acquired = br#"{"type":"acquired","key":"k","token":7,"lease_id":"L1","fencing_token":"v1.x","ttl_ms":1000,"state":"held"}"#;
        match parse(acquired) {
            Ok(Event::Acquired(l)) => {
                assert_eq!((l.key.as_str(), l.token, l.ttl_ms), ("k", 7, 1000));
                assert_eq!(
                    (l.lease_id.as_str(), l.fencing_token.as_str()),
                    ("L1", "v1.x")
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(br#"{"type":"heartbeat","remaining_ms":900,"token":7}"#),
            Ok(Event::Heartbeat)
        ));
        assert!(matches!(
            parse(br#"{"type":"lost","reason":"deadline","key":"k"}"#),
            Ok(Event::Lost { reason }) if reason == "deadline"
        ));
        assert!(matches!(
            parse(br#"{"type":"released","reason":"shutdown","key":"k"}"#),
            Ok(Event::Released { reason }) if reason == "shutdown"
        ));
        assert!(parse(br#"{"type":"acquired","key":"k"}"#).is_err());
        assert!(parse(br#"{"type":"party"}"#).is_err());
        assert!(parse(b"not json").is_err());
    }
}
