//! Registering a new token at the gateway before the acquire returns.
//!
//! Fencing writes alone loses read-modify-write updates: a woken old holder
//! can write between the new holder's read and its write (both pass the
//! check). Registering the new token first closes that window: from the
//! moment the application holds the lease, the gateway refuses every
//! earlier token.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::http::tls_client::{Connector, UpstreamTls, PREREGISTER};
use crate::lock::LockKey;

pub struct Preregistrar {
    client: Client<Connector, Full<Bytes>>,
    /// `http://gateway:8080/_fencer/v1/fences/` (or `https://`)
    base: String,
    timeout: Duration,
}

#[derive(Debug)]
pub enum PreregisterError {
    /// The gateway has seen a higher token for the key.
    Stale {
        highest: u64,
    },
    Failed(String),
}

impl Preregistrar {
    /// For `base` (validated by the settings); for `https://` the files
    /// of `tls` are read now.
    pub fn new(base: &str, tls: &UpstreamTls, timeout: Duration) -> Result<Preregistrar, String> {
        let https = base
            .get(..8)
            .is_some_and(|p| p.eq_ignore_ascii_case("https://"));
        let scheme = if https { "https" } else { "http" };
        let connector = Connector::new(PREREGISTER, scheme, tls, timeout)?;
        Ok(Preregistrar {
            client: Client::builder(TokioExecutor::new()).build(connector),
            base: base.to_owned(),
            timeout,
        })
    }

    pub async fn register(
        &self,
        key: &LockKey,
        fencing_token: &str,
    ) -> Result<(), PreregisterError> {
        let url = format!(
            "{}{}",
            self.base,
            percent_encoding::utf8_percent_encode(key.as_str(), percent_encoding::NON_ALPHANUMERIC)
        );
        let mut req = hyper::Request::post(url)
            .header("fencing-token", fencing_token)
            .body(Full::new(Bytes::new()))
            .map_err(|e| PreregisterError::Failed(e.to_string()))?;
        // The gateway's span of it joins the acquire's trace (tracing on).
        crate::telemetry::propagation::inject(req.headers_mut());
        let call = async {
            let resp = self.client.request(req).await.map_err(|e| {
                PreregisterError::Failed(format!(
                    "{}: {}",
                    self.base,
                    crate::error_chain::chain(&e)
                ))
            })?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| PreregisterError::Failed(e.to_string()))?
                .to_bytes();
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            match status.as_u16() {
                200 => Ok(()),
                409 if json["error"] == "stale_fencing_token" => Err(PreregisterError::Stale {
                    highest: json["highest_seen"].as_u64().unwrap_or(0),
                }),
                other => Err(PreregisterError::Failed(format!(
                    "{} answered {other}: {json}",
                    self.base
                ))),
            }
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| {
                PreregisterError::Failed(format!(
                    "{}: no answer within {:?}",
                    self.base, self.timeout
                ))
            })?
    }
}
