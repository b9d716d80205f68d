//! What a token-bearing request may touch: its token's signature, the key
//! the token names, and the key the request's path is bound to.

use hyper::body::Incoming;
use hyper::{Request, StatusCode};

use super::state::{Gateway, KEY_HEADER, SEQ_HEADER, TOKEN_HEADER};
use crate::error::ApiError;
use crate::routes::path::{normalize_uri, PathError};
use crate::token::Claim;

/// A refusal: the `result` label it is counted under and the response.
pub type Refusal = (&'static str, ApiError);

impl Gateway {
    /// Puts a fenced request's path in normal form (rewriting its URI, so
    /// the storage sees exactly the path that was checked) or refuses it.
    pub(super) fn normalize_path(&self, req: &mut Request<Incoming>) -> Result<(), Refusal> {
        *req.uri_mut() = normalize_uri(req.uri()).map_err(|e| {
            // Path parameters get a result of their own: they are the
            // route-binding bypass of issue 26 item 8, worth seeing apart
            // from clients that send sloppy paths.
            let result = match e {
                PathError::Parameters => "path_parameters",
                _ => "invalid_path",
            };
            (
                result,
                ApiError::invalid(
                    "path",
                    format!("{e}: fenced requests need an unambiguous path"),
                ),
            )
        })?;
        Ok(())
    }

    /// Verifies the token's signature (and range).
    pub(super) fn verify_signature(&self, req: &Request<Incoming>) -> Result<Claim, Refusal> {
        let invalid = |msg: String| {
            (
                "invalid_token",
                ApiError::new(StatusCode::FORBIDDEN, "invalid_fencing_token", msg),
            )
        };
        let raw = req.headers()[TOKEN_HEADER]
            .to_str()
            .map_err(|_| invalid("Fencing-Token is not ASCII".into()))?;
        if crate::mutants::active("skip_signature") {
            if let Some(c) = crate::token::parse_unverified(raw) {
                return Ok(c);
            }
        }
        let claim = self
            .keyring
            .verify(raw)
            .map_err(|e| invalid(format!("Fencing-Token rejected: {e}")))?;
        if i64::try_from(claim.token).is_err() {
            return Err(invalid("token out of range".into()));
        }
        Ok(claim)
    }

    /// Verifies the signature and that the token's key is the key this
    /// request may touch: `Fencing-Key` if sent, and the key the path is
    /// bound to when routes are configured — a path that matches no route
    /// is refused then, or any token could write it.
    pub(super) fn verify(&self, req: &Request<Incoming>) -> Result<Claim, Refusal> {
        let claim = self.verify_signature(req)?;
        let mismatch = |bound: &str| {
            (
                "key_mismatch",
                ApiError::new(
                    StatusCode::FORBIDDEN,
                    "invalid_fencing_token",
                    format!(
                        "the token is for key `{}`, this request needs `{bound}`",
                        claim.key
                    ),
                ),
            )
        };
        if let Some(header_key) = req.headers().get(KEY_HEADER) {
            if header_key.as_bytes() != claim.key.as_bytes() {
                return Err(mismatch(&String::from_utf8_lossy(header_key.as_bytes())));
            }
        }
        if !self.routes.is_empty() {
            match self.routes.key_for(req.uri().path()) {
                Some(bound) if bound == claim.key => {}
                Some(bound) => return Err(mismatch(&bound)),
                None => {
                    return Err((
                        "path_not_routed",
                        ApiError::new(
                            StatusCode::FORBIDDEN,
                            "path_not_routed",
                            "routes are configured and this path matches none of them (a route's {variable} matches only its var_chars, by default A-Z a-z 0-9 - _): no token may write it",
                        )
                        .with("key", claim.key.as_str()),
                    ))
                }
            }
        }
        Ok(claim)
    }
}

/// The optional `Fencing-Seq` header: a positive integer.
pub(super) fn sequence(req: &Request<Incoming>) -> Result<Option<u64>, ApiError> {
    let Some(raw) = req.headers().get(SEQ_HEADER) else {
        return Ok(None);
    };
    if crate::mutants::active("ignore_sequence") {
        return Ok(None);
    }
    raw.to_str()
        .ok()
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| (1..=i64::MAX as u64).contains(s))
        .map(Some)
        .ok_or_else(|| {
            ApiError::invalid(
                "Fencing-Seq",
                "Fencing-Seq must be an integer between 1 and 2^63-1",
            )
        })
}
