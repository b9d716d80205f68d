//! The benchmark's HTTP client: one keep-alive HTTP/1.1 connection per
//! simulated application thread, as a service with a persistent
//! connection to its sidecar has. No pool bookkeeping per request, so the
//! client's own cost is close to the minimum any HTTP client pays and the
//! comparison with an in-process Redis client is about the sidecar.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;

pub struct ApiConn {
    authority: String,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl ApiConn {
    /// `base` is `http://host:port` (a trailing path is ignored) or
    /// `unix:/path/to/socket`.
    pub fn new(base: &str) -> ApiConn {
        let authority = match base.strip_prefix("unix:") {
            Some(path) => format!("unix:{path}"),
            None => base
                .trim_start_matches("http://")
                .split('/')
                .next()
                .unwrap_or_default()
                .to_owned(),
        };
        ApiConn {
            authority,
            sender: None,
        }
    }

    fn host(&self) -> &str {
        if self.authority.starts_with("unix:") {
            "localhost"
        } else {
            &self.authority
        }
    }

    async fn sender(&mut self) -> Result<&mut SendRequest<Full<Bytes>>, String> {
        if self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            let connect_err = |e: std::io::Error| format!("connect {}: {e}", self.authority);
            let sender = match self.authority.strip_prefix("unix:") {
                Some(path) => {
                    let stream = tokio::net::UnixStream::connect(path)
                        .await
                        .map_err(connect_err)?;
                    handshake(stream).await?
                }
                None => {
                    let stream = tokio::net::TcpStream::connect(&self.authority)
                        .await
                        .map_err(connect_err)?;
                    stream.set_nodelay(true).map_err(|e| e.to_string())?;
                    handshake(stream).await?
                }
            };
            self.sender = Some(sender);
        }
        let sender = self.sender.as_mut().expect("connected above");
        if let Err(e) = sender.ready().await {
            self.sender = None;
            return Err(e.to_string());
        }
        Ok(self.sender.as_mut().expect("connected above"))
    }

    /// Sends `method path` with `headers` and `body`; returns the status and
    /// the whole response body.
    pub async fn send(
        &mut self,
        method: hyper::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<(u16, Bytes), String> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, self.host());
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        let result = self.sender().await?.send_request(req).await;
        let resp = match result {
            Ok(r) => r,
            Err(e) => {
                self.sender = None;
                return Err(e.to_string());
            }
        };
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, bytes))
    }

    /// PUTs `body` to `path` and records its latency in `r`: a refusal
    /// (non-2xx) ends the run with an error naming `what`; a transport
    /// error is counted.
    pub async fn put_timed(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
        r: &mut super::stats::Report,
        what: &str,
    ) -> Result<(), String> {
        let t0 = std::time::Instant::now();
        match self.send(hyper::Method::PUT, path, headers, body).await {
            Ok((200..=299, _)) => {
                r.record(std::time::Duration::ZERO, t0.elapsed());
                Ok(())
            }
            Ok((status, body)) => Err(format!(
                "{what} write refused: {status} {}",
                String::from_utf8_lossy(&body)
            )),
            Err(_) => {
                r.errors += 1;
                Ok(())
            }
        }
    }

    /// POSTs a JSON body.
    pub async fn post_json(&mut self, path: &str, body: String) -> Result<(u16, Bytes), String> {
        self.send(
            hyper::Method::POST,
            path,
            &[("content-type", "application/json")],
            Bytes::from(body),
        )
        .await
    }
}

/// HTTP/1.1 over any stream; the connection runs as its own task.
async fn handshake<S>(stream: S) -> Result<SendRequest<Full<Bytes>>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(sender)
}
