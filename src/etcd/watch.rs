//! A watch stream of the JSON gateway: one HTTP answer that never ends,
//! carrying one JSON message per line (`{"result": …}`), read as it comes.

use bytes::{Buf, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use super::error::EtcdError;
use super::wire::WatchResponse;

/// The longest message read: a watch on one key carries a few events at a
/// time; this bounds a misbehaving member.
const MAX_MESSAGE_BYTES: usize = 1 << 20;

pub struct Watch {
    body: Incoming,
    buf: BytesMut,
}

impl Watch {
    pub(super) fn new(body: Incoming) -> Watch {
        Watch {
            body,
            buf: BytesMut::new(),
        }
    }

    /// The next message; an error when the stream ended (the member went
    /// away: watch again) or spoke nonsense. Not bounded in time: the
    /// caller's wait is.
    pub async fn next(&mut self) -> Result<WatchResponse, EtcdError> {
        loop {
            if let Some(end) = self.buf.iter().position(|b| *b == b'\n') {
                let line = self.buf.split_to(end + 1);
                let line = &line[..end];
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return parse(line);
            }
            if self.buf.len() > MAX_MESSAGE_BYTES {
                return Err(EtcdError::Protocol(format!(
                    "a watch message over {MAX_MESSAGE_BYTES} bytes"
                )));
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(mut data) = frame.into_data() {
                        while data.has_remaining() {
                            let chunk = data.chunk();
                            self.buf.extend_from_slice(chunk);
                            let n = chunk.len();
                            data.advance(n);
                        }
                    }
                }
                Some(Err(e)) => {
                    return Err(EtcdError::Unavailable(format!("watch stream: {e}")));
                }
                None => {
                    // A last message without its newline.
                    if !self.buf.iter().all(u8::is_ascii_whitespace) {
                        let rest = self.buf.split();
                        return parse(&rest);
                    }
                    return Err(EtcdError::Unavailable("the watch stream ended".into()));
                }
            }
        }
    }
}

fn parse(line: &[u8]) -> Result<WatchResponse, EtcdError> {
    let v: Value = serde_json::from_slice(line)
        .map_err(|e| EtcdError::Protocol(format!("watch message: {e}")))?;
    if let Some(error) = v.get("error") {
        return Err(EtcdError::Unavailable(format!("watch: {error}")));
    }
    serde_json::from_value(v["result"].clone())
        .map_err(|e| EtcdError::Protocol(format!("watch message: {e}")))
}
