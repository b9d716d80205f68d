//! Serving a hyper service on a listener with graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::ProxyBody;

/// Accepts connections until `shutdown`, serving each with `handler`
/// (HTTP/1.1 keep-alive or h2c), then lets open connections finish their
/// current request for up to `drain`.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: Arc<H>,
    shutdown: CancellationToken,
    drain: Duration,
) where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let tracker = tokio_util::task::TaskTracker::new();
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let fut = handler(req);
                async move { Ok::<_, Infallible>(fut.await) }
            });
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                // Bound how long a client may take to send its headers.
                .header_read_timeout(Duration::from_secs(30))
                .max_buf_size(64 * 1024);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    tracker.close();
    let _ = tokio::time::timeout(drain, tracker.wait()).await;
}
