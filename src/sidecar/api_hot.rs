//! The lock API's two hottest routes, `POST /v1/locks/{key}/acquire` and
//! `…/release`, served without the router.
//!
//! Every lock cycle is one acquire and one release. Through the router each
//! request paid for route matching, two `from_fn` middlewares (each boxing
//! the inner service and its future), the body-limit layer and the
//! extractors — about a fifth of the sidecar's instructions per cycle
//! (docs/performance.md). Here the two routes are recognised from the path
//! alone and run the very handler code the router runs
//! ([`super::api::acquire_key`], [`super::api::release_key`]), with the same
//! body limit, error shapes and request counting.
//!
//! Anything not positively recognised goes to the router unchanged: other
//! methods and routes, a key segment that does not percent-decode to
//! UTF-8, and every request while tracing is on (the router's span layer
//! names the span). So the router stays the one place that defines the
//! API, and this is only a shorter road to two of its answers.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request};
use prometheus::IntCounter;
use tower::Service;

use super::api_state::ApiState;
use crate::error::ApiError;
use crate::settings::limits::MAX_BODY_BYTES;

/// The two routes served here.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Hot {
    Acquire,
    Release,
}

impl Hot {
    /// The route as the router names it (the `route` label of
    /// `fencer_http_requests_total`).
    fn route(self) -> &'static str {
        match self {
            Hot::Acquire => "/v1/locks/{key}/acquire",
            Hot::Release => "/v1/locks/{key}/release",
        }
    }
}

/// `Some((route, percent-decoded key))` for `POST /v1/locks/<one
/// segment>/acquire|release`, as the router would match it.
fn recognise<'a>(method: &Method, path: &'a str) -> Option<(Hot, std::borrow::Cow<'a, str>)> {
    if method != Method::POST {
        return None;
    }
    let rest = path.strip_prefix("/v1/locks/")?;
    let (segment, hot) = if let Some(s) = rest.strip_suffix("/acquire") {
        (s, Hot::Acquire)
    } else {
        (rest.strip_suffix("/release")?, Hot::Release)
    };
    if segment.is_empty() || segment.contains('/') {
        return None;
    }
    let key = percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .ok()?;
    Some((hot, key))
}

/// The lock API service: the hot routes here, the rest by `router`.
#[derive(Clone)]
pub struct LockApiService {
    router: Router,
    state: Arc<ApiState>,
    /// `fencer_http_requests_total` for the hot routes' 200 answers,
    /// looked up once instead of per request.
    ok: [IntCounter; 2],
}

impl LockApiService {
    pub fn new(router: Router, state: Arc<ApiState>) -> LockApiService {
        let ok = [Hot::Acquire, Hot::Release].map(|hot| {
            state
                .metrics
                .http_requests
                .with_label_values(&[hot.route(), "200"])
        });
        LockApiService { router, state, ok }
    }
}

type Answer = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl Service<Request<Incoming>> for LockApiService {
    type Response = Response;
    type Error = Infallible;
    type Future = Answer;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Answer {
        let hot = if crate::telemetry::tracing_enabled() {
            None
        } else {
            recognise(req.method(), req.uri().path()).map(|(hot, key)| (hot, key.into_owned()))
        };
        let Some((hot, key)) = hot else {
            let mut router = self.router.clone();
            return Box::pin(async move { router.call(req.map(Body::new)).await });
        };
        let state = self.state.clone();
        let ok = self.ok[hot as usize].clone();
        Box::pin(async move {
            let resp = match answer(&state, hot, &key, req.into_body()).await {
                Ok(resp) => resp,
                Err(e) => e.into_response(),
            };
            if resp.status() == hyper::StatusCode::OK {
                ok.inc();
            } else {
                state
                    .metrics
                    .http_requests
                    .with_label_values(&[hot.route(), resp.status().as_str()])
                    .inc();
            }
            Ok(resp)
        })
    }
}

async fn answer(
    state: &ApiState,
    hot: Hot,
    key: &str,
    body: Incoming,
) -> Result<Response, ApiError> {
    let body = Limited::new(body, MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                super::api::too_large()
            } else {
                ApiError::invalid("body", format!("cannot read body: {e}"))
            }
        })?
        .to_bytes();
    match hot {
        Hot::Acquire => super::api::acquire_key(state, key, &body).await,
        Hot::Release => super::api::release_key(state, key, &body).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_only_what_the_router_routes_to_the_same_handler() {
        let post = Method::POST;
        let key = |p: &str| recognise(&post, p).map(|(h, k)| (h, k.into_owned()));
        assert_eq!(key("/v1/locks/a/acquire"), Some((Hot::Acquire, "a".into())));
        assert_eq!(
            key("/v1/locks/a%2Fb/release"),
            Some((Hot::Release, "a/b".into()))
        );
        assert_eq!(
            key("/v1/locks/%E2%9C%93/acquire"),
            Some((Hot::Acquire, "✓".into()))
        );
        for other in [
            "/v1/locks//acquire",
            "/v1/locks/a/b/acquire",
            "/v1/locks/acquire",
            "/v1/locks/a/renew",
            "/v1/locks/a/acquire/",
            "/v1/locks/%FF/acquire",
            "/v1/lock/a/acquire",
            "/V1/locks/a/acquire",
        ] {
            assert_eq!(key(other), None, "{other}");
        }
        assert!(recognise(&Method::GET, "/v1/locks/a/acquire").is_none());
        assert!(recognise(&Method::PUT, "/v1/locks/a/release").is_none());
    }
}
