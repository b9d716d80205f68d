//! The HTTP client the OTLP exporter sends spans with: hyper (already
//! fencer's HTTP stack), on a one-thread runtime of its own.
//!
//! Why its own runtime: the SDK's batch processor exports from a plain
//! thread, where a tokio-based client finds no reactor; and exporting on
//! the role's runtime would put span uploads on the sidecar's one thread,
//! between lock requests. A blocking client would bring a second HTTP
//! stack for one call a second. So each export request is spawned on the
//! `fencer-otlp` thread's runtime and awaited from the exporter's thread.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use opentelemetry_http::{HttpClient, HttpError, Request, Response};

/// The largest collector answer read: an OTLP export response is a few
/// bytes (a partial-success note at most).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

pub struct ExportClient {
    runtime: tokio::runtime::Handle,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl std::fmt::Debug for ExportClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportClient")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ExportClient {
    /// Starts the `fencer-otlp` thread. `timeout` bounds each request
    /// from connect to the last byte of the answer.
    pub fn start(timeout: Duration) -> std::io::Result<ExportClient> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let runtime = rt.handle().clone();
        // The thread only drives the runtime; it ends with the process.
        std::thread::Builder::new()
            .name("fencer-otlp".into())
            .spawn(move || rt.block_on(std::future::pending::<()>()))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(2)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Ok(ExportClient {
            runtime,
            client,
            timeout,
        })
    }
}

#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error("the collector did not answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Http(String),
    #[error("the export task ended without an answer")]
    TaskGone,
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let timeout = self.timeout;
        let task = self.runtime.spawn(async move {
            let exchange = async {
                let resp = client
                    .request(request.map(Full::new))
                    .await
                    .map_err(|e| ExportError::Http(crate::error_chain::chain(&e)))?;
                let (parts, body) = resp.into_parts();
                let body = Limited::new(body, MAX_RESPONSE_BYTES)
                    .collect()
                    .await
                    .map_err(|e| ExportError::Http(e.to_string()))?
                    .to_bytes();
                Ok::<_, ExportError>(Response::from_parts(parts, body))
            };
            tokio::time::timeout(timeout, exchange)
                .await
                .unwrap_or(Err(ExportError::Timeout(timeout)))
        });
        match task.await {
            Ok(result) => result.map_err(|e| Box::new(e) as HttpError),
            Err(_) => Err(Box::new(ExportError::TaskGone)),
        }
    }
}
