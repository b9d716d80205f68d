//! A TLS listener for the shared server ([`super::server::serve_service`]):
//! the injector's webhook and the gateway.
//!
//! TLS is handshaken lazily inside the connection's task (see [`LazyTls`]),
//! so one slow or half-open client never holds up the accept loop, and the
//! shared server bounds connections, header time and the drain as for
//! every other listener.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Called for each failed handshake: the error, or `None` when it timed
/// out. Counts and logs it for the listener that owns it.
pub type OnFailure = fn(Option<&io::Error>);

pub struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    handshake_timeout: Duration,
    on_failure: OnFailure,
}

impl TlsListener {
    pub fn new(
        tcp: TcpListener,
        config: rustls::ServerConfig,
        handshake_timeout: Duration,
        on_failure: OnFailure,
    ) -> TlsListener {
        TlsListener {
            tcp,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            handshake_timeout,
            on_failure,
        }
    }
}

impl super::server::Accept for TlsListener {
    type Io = LazyTls;
    async fn accept_io(&self) -> io::Result<LazyTls> {
        let (stream, _) = self.tcp.accept().await?;
        let _ = stream.set_nodelay(true);
        let handshake = tokio::time::timeout(self.handshake_timeout, self.acceptor.accept(stream));
        Ok(LazyTls::Handshaking(Box::pin(handshake), self.on_failure))
    }
}

type Handshake = tokio::time::Timeout<tokio_rustls::Accept<TcpStream>>;

/// A server TLS stream whose handshake runs on first use, in the
/// connection's own task.
pub enum LazyTls {
    Handshaking(Pin<Box<Handshake>>, OnFailure),
    Ready(Box<TlsStream<TcpStream>>),
    Failed,
}

impl LazyTls {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<&mut TlsStream<TcpStream>>> {
        if let LazyTls::Handshaking(h, on_failure) = self {
            let on_failure = *on_failure;
            let result = ready!(h.as_mut().poll(cx));
            *self = match result {
                Ok(Ok(stream)) => LazyTls::Ready(Box::new(stream)),
                Ok(Err(e)) => {
                    on_failure(Some(&e));
                    *self = LazyTls::Failed;
                    return Poll::Ready(Err(e));
                }
                Err(_) => {
                    on_failure(None);
                    *self = LazyTls::Failed;
                    return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
                }
            };
        }
        match self {
            LazyTls::Ready(s) => Poll::Ready(Ok(s)),
            _ => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }
}

impl AsyncRead for LazyTls {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let stream = ready!(self.get_mut().poll_ready(cx))?;
        Pin::new(stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for LazyTls {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let stream = ready!(self.get_mut().poll_ready(cx))?;
        Pin::new(stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LazyTls::Ready(s) => Pin::new(s.as_mut()).poll_flush(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LazyTls::Ready(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            _ => Poll::Ready(Ok(())),
        }
    }
}
