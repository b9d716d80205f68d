//! Serving a hyper service on a listener with graceful shutdown — used by
//! the lock API (TCP and Unix socket), the egress proxy and the gateway, so
//! all three bound the same things: time to the first byte and to send
//! request headers, time without a request in flight ([`super::conn`]),
//! open connections, descriptors ([`super::pressure`]), and the drain on
//! shutdown.

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

use super::conn::{Activity, Close, Silence, Tracked, Watched};
use super::pressure::{
    self, is_fd_limit, needs_backoff, RateLimited, Registration, Reserve, Silent,
};
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
    /// How long a client may take to send a request's headers. On HTTP/1
    /// this also closes a keep-alive connection idle that long.
    pub header_read_timeout: Duration,
    /// Open connections at most; beyond it the server sheds a connection
    /// that has not sent a byte, else stops accepting (new clients wait
    /// in the kernel's backlog) until one closes.
    pub max_connections: usize,
    /// On shutdown, how long open connections may finish their request.
    pub drain: Duration,
    /// How long a connection may stay silent (`[http]`).
    pub silence: Silence,
}

/// h2 keep-alive: a PING this often, and the connection closed when one
/// goes unanswered this long — a vanished peer of a long request (a
/// blocking acquire, a `/hold` stream) does not keep its connection. hyper
/// pings whether or not a stream is open, so an h2 peer that never answers
/// is closed after ~40 s, before the idle bound (measured: 40.0 s).
const H2_PING_INTERVAL: Duration = Duration::from_secs(20);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

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
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let tracker = tokio_util::task::TaskTracker::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let silent = Arc::new(Silent::default());
    let mut at_limit = Pressure::new(limits.listener);
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
                // The shed connection counts itself when it closes.
                let shed = silent.shed_oldest().await;
                if at_limit.warn.tick().is_some() {
                    tracing::warn!(
                        listener = limits.listener,
                        max_connections = limits.max_connections,
                        shed,
                        "connection limit reached; shedding a silent connection or waiting until one closes"
                    );
                }
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
                    at_limit.accept_failed(&listener, &silent, e).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let registration = silent.register();
        let conn = Conn {
            silent: silent.clone(),
            registration,
            limits,
            shutdown: shutdown.clone(),
        };
        let service = service.clone();
        let open = open.clone();
        open.inc();
        tracker.spawn(async move {
            let _permit = permit;
            let _open = OnDrop::new(move || open.dec());
            conn.serve(stream, service).await;
        });
    }
    tracker.close();
    let _ = tokio::time::timeout(limits.drain, tracker.wait()).await;
}

/// One accepted connection and what may end it.
struct Conn {
    silent: Arc<Silent>,
    registration: Registration,
    limits: Limits,
    shutdown: CancellationToken,
}

impl Conn {
    async fn serve<Io, S, B>(self, stream: Io, service: S)
    where
        Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
        S: hyper::service::Service<Request<Incoming>, Response = Response<B>>
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: http_body::Body + Send + Unpin + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let Conn {
            silent,
            registration,
            limits,
            shutdown,
        } = self;
        // Dropped last, after the stream: a shedder waits for this.
        let _closed = registration.closed;
        let activity = Activity::new();
        let tracked = {
            let activity = activity.clone();
            hyper::service::service_fn(move |req| {
                let in_flight = activity.begin();
                let response = service.call(req);
                async move {
                    let response = response.await?;
                    Ok::<_, S::Error>(response.map(|body| Tracked::new(body, in_flight)))
                }
            })
        };
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size(64 * 1024);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(H2_PING_INTERVAL)
            .keep_alive_timeout(H2_PING_TIMEOUT);
        let io = TokioIo::new(Watched::new(stream, activity.clone()));
        let conn = builder.serve_connection(io, tracked);
        tokio::pin!(conn);
        let watch = async {
            tokio::select! {
                _ = activity.first_byte() => {}
                _ = tokio::time::sleep(limits.silence.first_byte) => {
                    silent.spoke(registration.id);
                    return Close::FirstByteTimeout;
                }
                _ = registration.shed.cancelled() => return Close::Shed,
            }
            if !silent.spoke(registration.id) {
                // Shed just as it spoke: the shedder counts on this
                // descriptor.
                return Close::Shed;
            }
            activity.idle_for(limits.silence.idle).await;
            Close::IdleTimeout
        };
        let close = tokio::select! {
            _ = conn.as_mut() => {
                silent.spoke(registration.id);
                return;
            }
            _ = shutdown.cancelled() => None,
            close = watch => Some(close),
        };
        match close {
            None => {
                silent.spoke(registration.id);
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
            Some(close) => {
                crate::metrics::SERVER
                    .closed
                    .with_label_values(&[limits.listener, close.as_str()])
                    .inc();
                tracing::debug!(
                    listener = limits.listener,
                    reason = close.as_str(),
                    "closing a silent connection"
                );
                if close == Close::IdleTimeout {
                    // h2: GOAWAY, so the client knows which requests were
                    // not taken; HTTP/1: closes at once (nothing in flight).
                    conn.as_mut().graceful_shutdown();
                    tokio::select! {
                        _ = conn.as_mut() => {}
                        _ = super::conn::grace(&activity) => {}
                    }
                }
                // Before the first byte there is nothing to finish: the
                // connection is dropped here.
            }
        }
    }
}

/// The accept loop's answer to a failing `accept` (see
/// [`super::pressure`]).
struct Pressure {
    listener: &'static str,
    reserve: Reserve,
    warn: RateLimited,
    fd_warn: RateLimited,
}

impl Pressure {
    fn new(listener: &'static str) -> Pressure {
        Pressure {
            listener,
            reserve: Reserve::new(),
            warn: RateLimited::default(),
            fd_warn: RateLimited::default(),
        }
    }

    async fn accept_failed<L: Accept>(&mut self, listener: &L, silent: &Silent, e: std::io::Error) {
        if !is_fd_limit(&e) {
            if let Some(n) = self.fd_warn.tick() {
                tracing::warn!(listener = self.listener, error = %e, occurrences = n, "accept failed");
            }
            if needs_backoff(&e) {
                pressure::backoff().await;
            }
            return;
        }
        let action = if silent.shed_oldest().await {
            "shed the oldest connection that had not sent a byte"
        } else {
            // Nothing to shed: accept the waiting client on the reserve
            // descriptor and close it, so it learns now, not at its timeout.
            let refused = self
                .reserve
                .release_for(async {
                    let accepted =
                        tokio::time::timeout(Duration::from_millis(100), listener.accept_io())
                            .await;
                    // Closed here, before the reserve is taken back.
                    matches!(accepted, Ok(Ok(_)))
                })
                .await;
            match refused {
                Some(true) => {
                    crate::metrics::SERVER
                        .refused
                        .with_label_values(&[self.listener, "fd_limit"])
                        .inc();
                    "refused a connection (closed at once)"
                }
                _ => {
                    pressure::backoff().await;
                    "no descriptor to refuse with; backing off"
                }
            }
        };
        tracing::debug!(listener = self.listener, action, "out of file descriptors");
        if let Some(n) = self.fd_warn.tick() {
            tracing::warn!(
                listener = self.listener, error = %e, occurrences = n, action,
                "out of file descriptors: raise the limit (ulimit -n) or find who holds the connections"
            );
        }
    }
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
pub async fn serve<L, H, F>(
    name: &'static str,
    listener: L,
    handler: Arc<H>,
    shutdown: CancellationToken,
    drain: Duration,
    silence: Silence,
) where
    L: Accept,
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
        silence,
    };
    serve_service(listener, service, shutdown, limits).await;
}
