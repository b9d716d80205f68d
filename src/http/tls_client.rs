//! TLS to an upstream (`https://`): proxy → gateway, sidecar → gateway
//! (pre-registration), gateway → storage.
//!
//! Tokens are signed, but without TLS the payloads — and the tokens
//! themselves — cross the network in clear unless a mesh adds it. The
//! server is always verified: against `ca_file` when given, else the
//! public web roots; there is deliberately no switch that skips
//! verification. Files are read once, at start, so a wrong path or a key
//! that does not match its certificate stops the start with the field
//! named instead of failing every request later.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::settings::check::invalid;
use crate::settings::check::ConfigError;

/// The TLS settings of one upstream link (`[proxy.upstream_tls]`,
/// `[sidecar.preregister_tls]`, `[gateway.upstream_tls]`). Used only when
/// the upstream URL is `https://`; set for an `http://` URL they are a
/// configuration error, not silently ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamTls {
    /// PEM bundle of the CA(s) that verify the server. Unset: the public
    /// web roots (a private CA then fails with `unknown_ca`).
    pub ca_file: Option<String>,
    /// PEM certificate chain presented to a server that asks for one
    /// (mTLS). Needs `client_key_file`.
    pub client_cert_file: Option<String>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `client_cert_file`.
    pub client_key_file: Option<String>,
    /// The name the server's certificate must carry, when it is not the
    /// URL's host (a gateway reached by IP, a certificate for the Service
    /// name reached through a port-forward).
    pub server_name: Option<String>,
}

/// Which link a connector serves: its label in
/// `fencer_tls_handshake_failures_total{link}` and the settings table that
/// configures it, named in errors.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    pub label: &'static str,
    pub field: &'static str,
}

pub const PROXY: Link = Link {
    label: "proxy_upstream",
    field: "proxy.upstream_tls",
};
pub const PREREGISTER: Link = Link {
    label: "preregister",
    field: "sidecar.preregister_tls",
};
pub const GATEWAY: Link = Link {
    label: "gateway_upstream",
    field: "gateway.upstream_tls",
};

impl UpstreamTls {
    fn is_set(&self) -> bool {
        self != &UpstreamTls::default()
    }

    /// The checks that need no file: settings only with `https://`, the
    /// client certificate and key together, a valid server name.
    pub fn validate(&self, link: Link, scheme: &str) -> Result<(), ConfigError> {
        if scheme != "https" && self.is_set() {
            return Err(invalid(
                link.field,
                "is set but the upstream URL is not https:// (TLS settings apply only to https://)",
            ));
        }
        if self.client_cert_file.is_some() != self.client_key_file.is_some() {
            return Err(invalid(
                link.field,
                "give client_cert_file and client_key_file together (or neither)",
            ));
        }
        if let Some(name) = &self.server_name {
            ServerName::try_from(name.as_str()).map_err(|_| {
                invalid(
                    link.field,
                    format!("server_name `{name}` is not a DNS name or IP address"),
                )
            })?;
        }
        Ok(())
    }

    /// The rustls client configuration: files read and parsed now.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, String> {
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(super::tls_roots::roots(self.ca_file.as_deref())?);
        let mut config = match (&self.client_cert_file, &self.client_key_file) {
            (Some(cert), Some(key)) => {
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                    .and_then(|it| it.collect::<Result<_, _>>())
                    .map_err(|e| format!("client_cert_file {cert}: {e}"))?;
                if chain.is_empty() {
                    return Err(format!("client_cert_file {cert}: no certificate"));
                }
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("client_key_file {key}: {e}"))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("client_cert_file / client_key_file: {e}"))?
            }
            _ => builder.with_no_client_auth(),
        };
        // The forwarders speak HTTP/1.1 upstream.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// A connector for one upstream: plain TCP for `http://`, TCP + TLS for
/// `https://`. TCP connect and handshake together are bounded by the
/// connect timeout: a server that accepts and never answers the
/// ClientHello must not hold a request until the upstream timeout.
#[derive(Clone)]
pub struct Connector {
    http: HttpConnector,
    tls: Option<Arc<TlsLink>>,
    timeout: Duration,
}

struct TlsLink {
    connector: TlsConnector,
    server_name: Option<ServerName<'static>>,
    link: Link,
}

impl Connector {
    /// For `scheme` (`http` or `https`); reads the TLS files of `tls`.
    pub fn new(
        link: Link,
        scheme: &str,
        tls: &UpstreamTls,
        connect_timeout: Duration,
    ) -> Result<Connector, String> {
        tls.validate(link, scheme).map_err(|e| e.to_string())?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        http.set_keepalive(Some(Duration::from_secs(30)));
        let tls = match scheme {
            "https" => Some(Arc::new(TlsLink {
                connector: TlsConnector::from(Arc::new(
                    tls.client_config()
                        .map_err(|e| format!("{}: {e}", link.field))?,
                )),
                server_name: tls
                    .server_name
                    .as_deref()
                    .map(|n| ServerName::try_from(n.to_owned()))
                    .transpose()
                    .map_err(|e| format!("{}.server_name: {e}", link.field))?,
                link,
            })),
            _ => None,
        };
        Ok(Connector {
            http,
            tls,
            timeout: connect_timeout,
        })
    }
}

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.http.poll_ready(cx).map_err(io::Error::other)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let origin = format!("https://{}", uri.authority().map_or("", |a| a.as_str()));
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_matches(['[', ']'])
            .to_owned();
        let connecting = self.http.call(uri);
        let tls = self.tls.clone();
        let timeout = self.timeout;
        let what = if tls.is_some() {
            "connect and TLS handshake"
        } else {
            "connect"
        };
        Box::pin(async move {
            let connect = async {
                let tcp = connecting.await.map_err(io::Error::other)?.into_inner();
                let Some(tls) = tls else {
                    return Ok(Stream::Plain(tcp));
                };
                tls.handshake(tcp, &host, &origin).await
            };
            match tokio::time::timeout(timeout, connect).await {
                Ok(result) => result.map(TokioIo::new),
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{what} took longer than {timeout:?}"),
                )),
            }
        })
    }
}

impl TlsLink {
    async fn handshake(&self, tcp: TcpStream, host: &str, origin: &str) -> io::Result<Stream> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => ServerName::try_from(host.to_owned())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        };
        let shown = name.to_str().into_owned();
        // A timeout inside the handshake surfaces as the caller's timeout;
        // count it here so it shows as a handshake failure too.
        let mut guard = TimeoutGuard {
            link: self.link.label,
            origin,
            armed: true,
        };
        let result = self.connector.connect(name, tcp).await;
        guard.armed = false;
        match result {
            Ok(stream) => Ok(Stream::Tls(Box::new(Tls {
                stream,
                unconfirmed: Some((self.link.label, origin.to_owned())),
            }))),
            Err(e) => {
                let reason = failure_reason(&e);
                crate::metrics::TLS
                    .handshake_failures
                    .with_label_values(&[self.link.label, reason])
                    .inc();
                tracing::warn!(
                    link = self.link.label, upstream = origin, server_name = %shown, reason, error = %e,
                    "TLS handshake with upstream failed"
                );
                Err(io::Error::new(
                    e.kind(),
                    format!("TLS handshake with {shown} failed ({reason}): {e}"),
                ))
            }
        }
    }
}

/// Counts a handshake abandoned by the connect timeout (dropped while
/// still armed).
struct TimeoutGuard<'a> {
    link: &'static str,
    origin: &'a str,
    armed: bool,
}

impl Drop for TimeoutGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            crate::metrics::TLS
                .handshake_failures
                .with_label_values(&[self.link, "timeout"])
                .inc();
            tracing::warn!(
                link = self.link,
                upstream = self.origin,
                reason = "timeout",
                "TLS handshake with upstream timed out"
            );
        }
    }
}

/// The bounded reason label of a failed handshake.
pub fn failure_reason(e: &io::Error) -> &'static str {
    use rustls::CertificateError as C;
    let Some(err) = e.get_ref().and_then(|r| r.downcast_ref::<rustls::Error>()) else {
        return "io";
    };
    match err {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer => "unknown_ca",
            C::NotValidForName | C::NotValidForNameContext { .. } => "name_mismatch",
            C::Expired
            | C::ExpiredContext { .. }
            | C::NotValidYet
            | C::NotValidYetContext { .. } => "expired",
            _ => "bad_certificate",
        },
        rustls::Error::AlertReceived(_) => "alert_received",
        _ => "other",
    }
}

/// Reason labels, each registered at zero.
pub const FAILURE_REASONS: &[&str] = &[
    "unknown_ca",
    "name_mismatch",
    "expired",
    "bad_certificate",
    "alert_received",
    "timeout",
    "io",
    "other",
];

/// An upstream connection: plain or TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<Tls>),
}

/// A TLS connection, and until its first bytes arrive the link and origin
/// to blame for a refusal: in TLS 1.3 a server that rejects the client's
/// certificate (or its absence) says so only after the client's side of
/// the handshake completed, as an alert on the first read. That is still
/// a handshake failure, counted and logged as one.
pub struct Tls {
    stream: TlsStream<TcpStream>,
    unconfirmed: Option<(&'static str, String)>,
}

impl Tls {
    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.stream).poll_read(cx, buf);
        if let Some((link, origin)) = &self.unconfirmed {
            match &result {
                Poll::Ready(Ok(())) if buf.filled().len() > before => self.unconfirmed = None,
                Poll::Ready(Err(e)) if failure_reason(e) != "io" => {
                    let reason = failure_reason(e);
                    crate::metrics::TLS
                        .handshake_failures
                        .with_label_values(&[link, reason])
                        .inc();
                    tracing::warn!(
                        link, upstream = %origin, reason, error = %e,
                        "upstream refused the TLS connection after the handshake (client certificate?)"
                    );
                    self.unconfirmed = None;
                }
                _ => {}
            }
        }
        result
    }
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        match self {
            Stream::Plain(s) => s.connected(),
            Stream::Tls(s) => s.stream.get_ref().0.connected(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => s.poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(&mut s.stream).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(&mut s.stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(&mut s.stream).poll_shutdown(cx),
        }
    }
}
