//! Serving a hyper service on a listener with graceful shutdown — used by
//! the lock API (TCP and Unix socket), the egress proxy and the gateway, so
//! all three bound the same things: time to send request headers, open
//! connections, and the drain on shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

use crate::proxy::ProxyBody;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where connections come from: TCP (with `TCP_NODELAY`: request/response
/// traffic must not wait for Nagle) or a Unix socket.
pub trait Accept: Send + 'static {
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static;
    fn accept_io(&self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept_io(&self) -> std::io::Result<Self::Io> {
        let (stream, _) = self.accept().await?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }
}

impl Accept for UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept_io(&self) -> std::io::Result<Self::Io> {
        Ok(self.accept().await?.0)
    }
}

/// What one server bounds.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The listener's name in `fencer_http_connections{listener}`.
    pub listener: &'static str,
    /// How long a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// Open connections at most; beyond it the server stops accepting
    /// (new clients wait in the kernel's backlog) until one closes.
    pub max_connections: usize,
    /// On shutdown, how long open connections may finish their request.
    pub drain: Duration,
}

/// Accepts connections until `shutdown`, serving each with `service`
/// (HTTP/1.1 keep-alive or h2c), then drains them for up to `limits.drain`.
pub async fn serve_service<L, S, B>(
    listener: L,
    service: S,
    shutdown: CancellationToken,
    limits: Limits,
) where
    L: Accept,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let tracker = tokio_util::task::TaskTracker::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let open = crate::metrics::SERVER
        .open
        .with_label_values(&[limits.listener]);
    let limit_waits = crate::metrics::SERVER
        .limit_waits
        .with_label_values(&[limits.listener]);
    loop {
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                limit_waits.inc();
                tracing::warn!(
                    listener = limits.listener,
                    max_connections = limits.max_connections,
                    "connection limit reached; not accepting until one closes"
                );
                tokio::select! {
                    p = slots.clone().acquire_owned() => p.expect("semaphore never closed"),
                    _ = shutdown.cancelled() => break,
                }
            }
        };
        let stream = tokio::select! {
            accepted = listener.accept_io() => match accepted {
                Ok(stream) => stream,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let service = service.clone();
        let shutdown = shutdown.clone();
        let open = open.clone();
        open.inc();
        tracker.spawn(async move {
            let _permit = permit;
            let _open = OnDrop::new(move || open.dec());
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
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
    let _ = tokio::time::timeout(limits.drain, tracker.wait()).await;
}

/// Runs `f` when dropped, however the scope ends (a connection's end, a
/// waiter giving up): for gauges that must come back down.
pub struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> OnDrop<F> {
    pub fn new(f: F) -> OnDrop<F> {
        OnDrop(Some(f))
    }
}

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// [`serve_service`] for a plain async handler (proxy, gateway).
pub async fn serve<H, F>(
    name: &'static str,
    listener: TcpListener,
    handler: Arc<H>,
    shutdown: CancellationToken,
    drain: Duration,
) where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let fut = handler(req);
        async move { Ok::<_, Infallible>(fut.await) }
    });
    let limits = Limits {
        listener: name,
        header_read_timeout: Duration::from_secs(30),
        max_connections: 16_384,
        drain,
    };
    serve_service(listener, service, shutdown, limits).await;
}
