//! HTTP error responses: every failure the API can report, mapped to a status
//! and a JSON body `{"error": code, "message": text, ...}` in this one place.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::sidecar::locks::LockError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub extra: Map<String, Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            extra: Map::new(),
        }
    }

    pub fn with(mut self, field: &str, value: impl Into<Value>) -> ApiError {
        self.extra.insert(field.to_owned(), value.into());
        self
    }

    /// 400 `invalid_request`, naming the offending field.
    pub fn invalid(field: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message).with("field", field)
    }

    /// 500 `internal_error`: a task that should have answered did not.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }
}

/// Response header naming the error code of a refusal by fencer's egress
/// proxy or gateway (never on an answer the storage gave).
pub const REFUSAL_HEADER: &str = "fencing-error";

/// The error code of an error response, in its extensions: the span of the
/// request records it as its outcome without reading the body back.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

impl ApiError {
    fn body(self) -> (StatusCode, Value) {
        let mut body = self.extra;
        body.insert("error".into(), json!(self.code));
        body.insert("message".into(), json!(self.message));
        (self.status, Value::Object(body))
    }

    /// The same JSON error for the raw-hyper servers (egress proxy, gateway),
    /// marked with [`REFUSAL_HEADER`]: through the proxy an application
    /// gets fencer's refusals and the storage's own answers on one
    /// connection, and a storage may well answer `{"error":
    /// "invalid_request"}` itself. The header — which the gateway strips
    /// from every storage answer — is what tells them apart.
    pub fn into_hyper(self) -> hyper::Response<crate::proxy::ProxyBody> {
        let code = ErrorCode(self.code);
        let (status, body) = self.body();
        hyper::Response::builder()
            .status(status)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(REFUSAL_HEADER, code.0)
            .extension(code)
            .body(crate::proxy::full(body.to_string()))
            .expect("static response parts")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = ErrorCode(self.code);
        let (status, body) = self.body();
        let mut resp = (status, axum::Json(body)).into_response();
        resp.extensions_mut().insert(code);
        resp
    }
}

impl From<LockError> for ApiError {
    fn from(err: LockError) -> ApiError {
        let message = err.to_string();
        match err {
            LockError::Held(key) => {
                ApiError::new(StatusCode::CONFLICT, "lock_held", message).with("key", key.as_str())
            }
            LockError::Delayed { key, retry_after } => {
                ApiError::new(StatusCode::CONFLICT, "lock_delayed", message)
                    .with("key", key.as_str())
                    .with("retry_after_ms", retry_after.as_millis().max(1) as u64)
            }
            LockError::RateLimited { retry_after } => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message)
                    .with("retry_after_ms", retry_after.as_millis().max(1) as u64)
            }
            LockError::Unsupported { feature, backend } => {
                ApiError::new(StatusCode::BAD_REQUEST, "unsupported_by_backend", message)
                    .with("feature", feature)
                    .with("backend", backend)
            }
            LockError::NoPermit { name, permits } => {
                ApiError::new(StatusCode::CONFLICT, "lock_held", message)
                    .with("key", name.as_str())
                    .with("permits", permits)
            }
            LockError::PermitsMismatch { name, fixed, .. } => {
                ApiError::new(StatusCode::CONFLICT, "permits_mismatch", message)
                    .with("key", name.as_str())
                    .with("permits", fixed)
            }
            LockError::TooManyHolds(max) => {
                ApiError::new(StatusCode::CONFLICT, "too_many_holds", message)
                    .with("max_holds", max)
            }
            LockError::ViewOff => ApiError::new(StatusCode::BAD_REQUEST, "view_off", message),
            LockError::LeaseLost(key) => {
                ApiError::new(StatusCode::CONFLICT, "lease_lost", message).with("key", key.as_str())
            }
            LockError::NotOwner(key) => {
                ApiError::new(StatusCode::CONFLICT, "not_owner", message).with("key", key.as_str())
            }
            LockError::NotFound(key) => ApiError::not_found(message).with("key", key.as_str()),
            LockError::UnknownGroup(_) => ApiError::not_found(message),
            LockError::TtlTooLong { max, .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "ttl_too_long", message)
                    .with("max_ttl_ms", max.as_millis() as u64)
            }
            LockError::MaxHold(key) => {
                ApiError::new(StatusCode::CONFLICT, "max_hold_reached", message)
                    .with("key", key.as_str())
            }
            LockError::NotHeld(key) => {
                ApiError::new(StatusCode::PRECONDITION_REQUIRED, "lock_not_held", message)
                    .with("key", key.as_str())
            }
            LockError::Backend(crate::lock::BackendError::NotReplicated(_)) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_replicated", message)
            }
            LockError::Backend(crate::lock::BackendError::Refused(_)) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "backend_refused", message)
            }
            LockError::Backend(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "backend_unavailable",
                message,
            ),
            LockError::TooManyWaiters(_) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_waiters", message)
            }
            LockError::TooManyLeases(_) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_leases", message)
            }
            LockError::GatewayUnavailable(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "gateway_unavailable",
                message,
            ),
            LockError::TokenBehind { key, highest } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "token_behind_gateway",
                message,
            )
            .with("key", key.as_str())
            .with("highest_seen", highest),
            LockError::TokenJump {
                key,
                highest,
                token,
            } => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "token_jump", message)
                .with("key", key.as_str())
                .with("highest_seen", highest)
                .with("token", token),
            LockError::ExpiredBeforeAnswer { key, .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "lease_expired_before_answer",
                message,
            )
            .with("key", key.as_str()),
            LockError::ShuttingDown => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", message)
            }
        }
    }
}
