//! Forwarding one request to a fixed upstream.

use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::ProxyBody;
use crate::http::tls_client::{Connector, Link, UpstreamTls};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
    #[error("upstream request failed: {0}")]
    Failed(String),
}

impl ForwardError {
    /// The outcome label (`timeout`, `error`) for metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            ForwardError::Timeout(_) => "timeout",
            ForwardError::Failed(_) => "error",
        }
    }

    /// The answer for the client: 504 `upstream_timeout` or 502
    /// `upstream_error` — both "the outcome at the upstream is unknown".
    pub fn to_response(&self) -> hyper::Response<super::ProxyBody> {
        let (status, code) = match self {
            ForwardError::Timeout(_) => (hyper::StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
            ForwardError::Failed(_) => (hyper::StatusCode::BAD_GATEWAY, "upstream_error"),
        };
        crate::error::ApiError::new(status, code, self.to_string()).into_hyper()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("upstream `{url}`: {reason}")]
pub struct UpstreamError {
    pub url: String,
    pub reason: String,
}

/// A pooled client bound to one upstream (`http://host:port` or
/// `https://host:port`).
#[derive(Clone)]
pub struct Forwarder {
    client: Client<Connector, ProxyBody>,
    scheme: hyper::http::uri::Scheme,
    authority: hyper::http::uri::Authority,
    host: HeaderValue,
    timeout: Duration,
    /// `scheme://host:port`, named by every failure: a 502 that says only
    /// "client error (Connect)" leaves the operator guessing which hop.
    origin: String,
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes the hop-by-hop headers of a message: the fixed list and every
/// header its `Connection` names. Proxy and gateway call it on a request
/// as it arrives, *before* adding headers of their own — otherwise a client
/// sending `Connection: fencing-seq` would have the proxy's own header
/// stripped on the way out (issue 9).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

impl Forwarder {
    /// A forwarder to `upstream`; for `https://` the TLS files of `tls`
    /// are read now (a bad file is a start-up error naming `link`).
    pub fn new(
        upstream: &str,
        (link, tls): (Link, &UpstreamTls),
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Result<Forwarder, UpstreamError> {
        let err = |reason: &str| UpstreamError {
            url: upstream.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: Uri = upstream.parse().map_err(|_| err("not a URL"))?;
        let scheme = match uri.scheme_str() {
            Some(s @ ("http" | "https")) => s,
            _ => return Err(err("expected an http:// or https:// URL")),
        };
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(err("give scheme, host and port only (no path)"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| err("missing host"))?;
        let connector = Connector::new(link, scheme, tls, connect_timeout).map_err(|e| err(&e))?;
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(256)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Ok(Forwarder {
            client,
            scheme: uri.scheme().cloned().expect("checked above"),
            host: HeaderValue::from_str(authority.as_str()).map_err(|_| err("bad host"))?,
            origin: format!("{scheme}://{authority}"),
            authority,
            timeout,
        })
    }

    /// Sends `req` (its path and query kept) to the upstream and returns the
    /// response once its headers arrived. The body streams afterwards.
    pub async fn forward(
        &self,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, ForwardError> {
        let path_and_query = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| hyper::http::uri::PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|e| ForwardError::Failed(format!("{}: {e}", self.origin)))?;
        *req.version_mut() = hyper::Version::HTTP_11;
        // The caller stripped the client's hop-by-hop headers on arrival
        // (and `Connection` with them); headers it added since stay.
        for name in HOP_BY_HOP {
            req.headers_mut().remove(*name);
        }
        req.headers_mut().insert(header::HOST, self.host.clone());
        // The current span's `traceparent` replaces the caller's (tracing on).
        crate::telemetry::propagation::inject(req.headers_mut());
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => Err(ForwardError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(ForwardError::Failed(format!(
                "{}: {}",
                self.origin,
                crate::error_chain::chain(&e)
            ))),
            Ok(Ok(mut resp)) => {
                strip_hop_by_hop(resp.headers_mut());
                Ok(resp)
            }
        }
    }
}
