//! The webhook's HTTPS listener and its one route, `POST /mutate`.
//!
//! TLS is handshaken lazily inside the connection's task (see [`LazyTls`]),
//! so one slow or half-open client never holds up the accept loop, and the
//! shared server ([`crate::http::server::serve_service`]) bounds
//! connections, header time and the drain as for every other listener.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::review::{self, answer};
use super::settings::InjectSettings;
use super::tls::ReloadingCert;
use crate::error::ApiError;
use crate::metrics::INJECT;

/// An AdmissionReview carries one object; etcd stores at most 1.5 MiB per
/// object, and the review may carry it twice (object, oldObject).
pub const MAX_REVIEW_BYTES: usize = 4 * 1024 * 1024;
/// The API server gives a webhook at most 30 s (10 s by default); the
/// handshake must be well inside that.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn serve(
    listener: TcpListener,
    cert: Arc<ReloadingCert>,
    settings: Arc<InjectSettings>,
    silence: crate::http::conn::Silence,
    shutdown: CancellationToken,
) {
    let tls = TlsListener {
        tcp: listener,
        acceptor: TlsAcceptor::from(Arc::new(cert.server_config())),
    };
    let service = hyper_util::service::TowerToHyperService::new(router(settings));
    let limits = crate::http::server::Limits {
        listener: "inject",
        header_read_timeout: Duration::from_secs(10),
        max_connections: 1024,
        drain: Duration::from_secs(10),
        silence,
    };
    crate::http::server::serve_service(tls, service, shutdown, limits).await;
}

pub fn router(settings: Arc<InjectSettings>) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .fallback(|| async { ApiError::not_found("injector routes: POST /mutate") })
        .with_state(settings)
}

async fn mutate(State(settings): State<Arc<InjectSettings>>, body: Body) -> Response {
    let started = Instant::now();
    let bytes = match read_body(body).await {
        Ok(b) => b,
        Err(e) => {
            INJECT.reviews.with_label_values(&["bad_request"]).inc();
            // The rest of the body was not read: the connection cannot
            // carry another request. Say so, or the client reuses it just
            // as the server closes it (IncompleteMessage on its next call).
            let mut response = e.into_response();
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            return response;
        }
    };
    let response = match answer(&bytes, &settings) {
        Ok(a) => {
            INJECT.reviews.with_label_values(&[a.result.as_str()]).inc();
            log(&a);
            Json(a.body).into_response()
        }
        Err(e) => {
            INJECT.reviews.with_label_values(&["bad_request"]).inc();
            tracing::warn!(error = %e, "request is not an AdmissionReview");
            ApiError::new(StatusCode::BAD_REQUEST, "bad_review", e.to_string()).into_response()
        }
    };
    INJECT
        .review_seconds
        .observe(started.elapsed().as_secs_f64());
    response
}

fn log(a: &review::Answer) {
    let (ns, pod, result) = (&a.namespace, &a.pod, a.result.as_str());
    match (&a.error, a.result) {
        (Some(e), _) => tracing::warn!(
            namespace = %ns, pod = %pod, result, reason = e.code(), error = %e,
            "pod asked for the fencer sidecar and did not get it"
        ),
        (None, review::Result::Injected) => {
            tracing::info!(namespace = %ns, pod = %pod, result, "fencer sidecar injected")
        }
        (None, _) => tracing::debug!(namespace = %ns, pod = %pod, result, "review answered"),
    }
}

async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    let limited = http_body_util::Limited::new(body, MAX_REVIEW_BYTES);
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("an AdmissionReview is at most {MAX_REVIEW_BYTES} bytes"),
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "body_unreadable",
            e.to_string(),
        )),
    }
}

struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
}

impl crate::http::server::Accept for TlsListener {
    type Io = LazyTls;
    async fn accept_io(&self) -> io::Result<LazyTls> {
        let (stream, _) = self.tcp.accept().await?;
        let _ = stream.set_nodelay(true);
        let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(stream));
        Ok(LazyTls::Handshaking(Box::pin(handshake)))
    }
}

type Handshake = tokio::time::Timeout<tokio_rustls::Accept<TcpStream>>;

/// A server TLS stream whose handshake runs on first use, in the
/// connection's own task.
pub enum LazyTls {
    Handshaking(Pin<Box<Handshake>>),
    Ready(Box<TlsStream<TcpStream>>),
    Failed,
}

impl LazyTls {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<&mut TlsStream<TcpStream>>> {
        if let LazyTls::Handshaking(h) = self {
            let result = ready!(h.as_mut().poll(cx));
            *self = match result {
                Ok(Ok(stream)) => LazyTls::Ready(Box::new(stream)),
                Ok(Err(e)) => {
                    INJECT.handshake_failures.inc();
                    tracing::debug!(error = %e, "webhook TLS handshake failed");
                    *self = LazyTls::Failed;
                    return Poll::Ready(Err(e));
                }
                Err(_) => {
                    INJECT.handshake_failures.inc();
                    tracing::debug!("webhook TLS handshake timed out");
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
