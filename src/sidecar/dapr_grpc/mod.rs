//! Dapr's gRPC API (`dapr.proto.runtime.v1.Dapr`) on a listener of its own
//! (`sidecar.dapr_grpc_listen`, off unless set): what Dapr's SDKs use by
//! default. fencer serves `TryLockAlpha1` and `UnlockAlpha1` (meaning
//! shared with the HTTP routes: [`super::dapr_lock`]) and `GetMetadata`
//! (the Node SDK's start-up check); every other method of the service, and
//! any other path, answers UNIMPLEMENTED at once, without reading the
//! request.
//!
//! Carried by the sidecar's own bounded HTTP server (h2c), routed by path,
//! with tonic's codec-level server for the gRPC framing — no protoc, no
//! second server stack. Bounded: each message at most
//! [`MAX_MESSAGE_BYTES`], at most [`MAX_IN_FLIGHT`] calls at once (more
//! answer RESOURCE_EXHAUSTED at once), each within the caller's
//! `grpc-timeout` and never longer than [`MAX_CALL`] (DEADLINE_EXCEEDED; an
//! acquire cut short is undone by the lock manager, as for a client that
//! goes away). An acquired lock's lease, signed token and key go back as
//! response metadata `fencing-lease`, `fencing-token`, `fencing-key`.

pub mod messages;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;
use tonic::metadata::MetadataValue;
use tonic::Status;

use self::messages::*;
use super::api_state::ApiState;
use super::dapr_lock::{self, DaprFailure, Op, Protocol, TryLock, Unlock};

/// The service's path prefix.
pub const SERVICE: &str = "/dapr.proto.runtime.v1.Dapr/";

/// Largest request (and response) message: Dapr's lock requests are a few
/// short strings (a store name, a key, an owner).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024;

/// Calls served at once; beyond it RESOURCE_EXHAUSTED, never a queue.
pub const MAX_IN_FLIGHT: usize = 1024;

/// The longest a call may take, whatever deadline the caller sent (a
/// TryLock never waits for a held lock; this bounds a slow backend).
pub const MAX_CALL: Duration = Duration::from_secs(30);

struct Grpc {
    api: Arc<ApiState>,
    in_flight: Arc<Semaphore>,
}

/// The gRPC service as a router, for [`crate::http::listen::serve`].
pub fn router(api: Arc<ApiState>) -> axum::Router {
    use axum::routing::post;
    let state = Arc::new(Grpc {
        api,
        in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
    });
    axum::Router::new()
        .route(&format!("{SERVICE}TryLockAlpha1"), post(try_lock))
        .route(&format!("{SERVICE}UnlockAlpha1"), post(unlock))
        .route(&format!("{SERVICE}GetMetadata"), post(get_metadata))
        .fallback(unimplemented)
        .with_state(state)
}

/// A tonic unary service from a closure.
struct Unary<F>(F);

impl<Req, Res, F, Fut> tonic::server::UnaryService<Req> for Unary<F>
where
    F: FnMut(tonic::Request<Req>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<Res>, Status>> + Send + 'static,
{
    type Response = Res;
    type Future = Fut;
    fn call(&mut self, request: tonic::Request<Req>) -> Fut {
        (self.0)(request)
    }
}

/// Serves one unary call: the concurrency bound, the deadline, the framing.
async fn unary<Req, Res, F, Fut>(g: &Grpc, op: Op, req: Request, handle: F) -> Response
where
    Req: prost::Message + Default + Send + 'static,
    Res: prost::Message + Send + 'static,
    F: FnMut(tonic::Request<Req>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<tonic::Response<Res>, Status>> + Send + 'static,
{
    let Ok(_permit) = g.in_flight.clone().try_acquire_owned() else {
        dapr_lock::count(&g.api, Protocol::Grpc, op, "busy");
        tracing::warn!(max = MAX_IN_FLIGHT, "dapr grpc: too many calls in flight");
        return status_response(Status::resource_exhausted(format!(
            "more than {MAX_IN_FLIGHT} Dapr calls in flight"
        )));
    };
    let limit = deadline(req.headers()).map_or(MAX_CALL, |d| d.min(MAX_CALL));
    if limit.is_zero() {
        return deadline_exceeded(&g.api, op, limit);
    }
    let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Res, Req>::default())
        .apply_max_message_size_config(Some(MAX_MESSAGE_BYTES), Some(MAX_MESSAGE_BYTES));
    match tokio::time::timeout(limit, grpc.unary(Unary(handle), req)).await {
        Ok(response) => response.map(axum::body::Body::new),
        Err(_) => deadline_exceeded(&g.api, op, limit),
    }
}

fn deadline_exceeded(api: &ApiState, op: Op, limit: Duration) -> Response {
    dapr_lock::count(api, Protocol::Grpc, op, "deadline");
    tracing::warn!(op = ?op, limit_ms = limit.as_millis() as u64, "dapr grpc: deadline exceeded");
    status_response(Status::deadline_exceeded(format!(
        "no answer within {} ms",
        limit.as_millis()
    )))
}

fn status_response(status: Status) -> Response {
    status.into_http::<axum::body::Body>().into_response()
}

/// The caller's `grpc-timeout` (gRPC over HTTP/2: at most 8 digits and a
/// unit), if it sent a valid one.
pub fn deadline(headers: &axum::http::HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A failure as gRPC status: the caller's fault INVALID_ARGUMENT, the
/// backend's INTERNAL; the message starts with Dapr's error code.
fn status_of(op: Op, e: DaprFailure) -> Status {
    let message = format!("{}: {e}", e.dapr_code(op));
    if e.is_client_error() {
        Status::invalid_argument(message)
    } else {
        Status::internal(message)
    }
}

async fn try_lock(State(g): State<Arc<Grpc>>, req: Request) -> Response {
    let api = g.api.clone();
    unary(
        &g,
        Op::Lock,
        req,
        move |r: tonic::Request<TryLockRequest>| {
            let api = api.clone();
            async move {
                let r = r.into_inner();
                let req = TryLock {
                    store: r.store_name,
                    resource_id: r.resource_id,
                    owner: r.lock_owner,
                    expiry_in_seconds: i64::from(r.expiry_in_seconds),
                };
                match dapr_lock::try_lock(&api, Protocol::Grpc, req).await {
                    Ok(Some(view)) => {
                        let mut response = tonic::Response::new(TryLockResponse { success: true });
                        for (name, value) in super::dapr::fencing_headers(&view) {
                            if let Ok(v) = MetadataValue::try_from(value) {
                                response.metadata_mut().insert(name, v);
                            }
                        }
                        Ok(response)
                    }
                    Ok(None) => Ok(tonic::Response::new(TryLockResponse { success: false })),
                    Err(e) => Err(status_of(Op::Lock, e)),
                }
            }
        },
    )
    .await
}

async fn unlock(State(g): State<Arc<Grpc>>, req: Request) -> Response {
    let api = g.api.clone();
    unary(
        &g,
        Op::Unlock,
        req,
        move |r: tonic::Request<UnlockRequest>| {
            let api = api.clone();
            async move {
                let r = r.into_inner();
                let req = Unlock {
                    store: r.store_name,
                    resource_id: r.resource_id,
                    owner: r.lock_owner,
                };
                match dapr_lock::unlock(&api, Protocol::Grpc, req).await {
                    Ok(status) => Ok(tonic::Response::new(UnlockResponse {
                        status: status as i32,
                    })),
                    Err(e) => Err(status_of(Op::Unlock, e)),
                }
            }
        },
    )
    .await
}

async fn get_metadata(State(g): State<Arc<Grpc>>, req: Request) -> Response {
    let api = g.api.clone();
    unary(
        &g,
        Op::Metadata,
        req,
        move |_: tonic::Request<GetMetadataRequest>| {
            let api = api.clone();
            async move {
                dapr_lock::count(&api, Protocol::Grpc, Op::Metadata, "success");
                let components = super::dapr_meta::components(&api)
                    .into_iter()
                    .map(|c| RegisteredComponents {
                        name: c.name,
                        r#type: c.kind,
                        version: c.version.to_owned(),
                        capabilities: Vec::new(),
                    })
                    .collect();
                Ok(tonic::Response::new(GetMetadataResponse {
                    id: super::dapr_meta::APP_ID.to_owned(),
                    registered_components: components,
                    extended_metadata: super::dapr_meta::extended(&api),
                    runtime_version: super::dapr_meta::runtime_version(),
                }))
            }
        },
    )
    .await
}

/// Every other path: UNIMPLEMENTED at once, the request left unread.
async fn unimplemented(State(g): State<Arc<Grpc>>, req: Request) -> Response {
    dapr_lock::count(&g.api, Protocol::Grpc, Op::Other, "unimplemented");
    let path = req.uri().path();
    let shown: String = path.chars().take(128).collect();
    tracing::debug!(path = %shown, "dapr grpc: unimplemented method");
    status_response(Status::unimplemented(format!(
        "fencer serves TryLockAlpha1, UnlockAlpha1 and GetMetadata of dapr.proto.runtime.v1.Dapr, not {shown}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(v: &str) -> Option<Duration> {
        let mut h = axum::http::HeaderMap::new();
        h.insert("grpc-timeout", v.parse().unwrap());
        deadline(&h)
    }

    #[test]
    fn grpc_timeouts_parse_by_unit_and_refuse_the_malformed() {
        assert_eq!(parsed("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parsed("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parsed("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parsed("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parsed("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parsed("0n"), Some(Duration::ZERO));
        for bad in ["", "S", "5", "5s", "-1S", "123456789S", "1.5S"] {
            assert_eq!(parsed(bad), None, "{bad}");
        }
    }
}
