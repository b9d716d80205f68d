//! Where the gateway decides what a request is: every request passes
//! through [`Gateway::handle`].
//!
//! A request is a read only if its method is in `gateway.read_methods`
//! (default `GET`, `HEAD`); every other method is a write. A request
//! carrying `Fencing-Token` (any method: a fenced read advances the mark
//! too) has its path put in normal form, its token verified against the key
//! it may touch, and is then admitted and forwarded by [`super::fenced`] in
//! a task of its own. Writes without a token are refused; reads without one
//! pass unchecked; a write carrying a read lease's token is refused
//! (`read_lease`). A request with any `Fencing-*` header twice is refused
//! before anything else, and the storage receives no `Fencing-*` header but
//! the checked token and sequence.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::time::Instant;

use super::state::{Gateway, SEQ_HEADER, TOKEN_HEADER};
use crate::error::ApiError;
use crate::proxy::forward::strip_hop_by_hop;
use crate::proxy::{headers, stream, ProxyBody};

impl Gateway {
    /// Counts and logs a refusal made before the request reached its key,
    /// and answers it.
    fn refuse(
        &self,
        req: &Request<Incoming>,
        kind: &str,
        result: &str,
        err: ApiError,
    ) -> Response<ProxyBody> {
        self.count("none", kind, result);
        tracing::info!(
            method = %req.method(), path = req.uri().path(), kind, result,
            "gateway refused a request"
        );
        err.into_hyper()
    }

    /// What a request is: a read only if its method is one of
    /// `gateway.read_methods`, compared exactly (methods are
    /// case-sensitive: `put` is not `PUT`, and not a read either).
    fn kind(&self, req: &Request<Incoming>) -> &'static str {
        if req.uri().path().starts_with(&self.fence_prefix) {
            "preregister"
        } else if headers::is_read(&self.read_methods, req.method()) {
            "read"
        } else {
            "write"
        }
    }

    pub async fn handle(self: Arc<Self>, mut req: Request<Incoming>) -> Response<ProxyBody> {
        strip_hop_by_hop(req.headers_mut());
        let kind = self.kind(&req);
        if self.enforce {
            if let Some(name) = headers::duplicated(req.headers()) {
                return self.refuse(
                    &req,
                    kind,
                    "duplicate_header",
                    headers::duplicate_error(&name),
                );
            }
        }
        if kind == "preregister" {
            return super::preregister::handle(self, req).await;
        }
        if !self.enforce {
            self.count("none", kind, "unenforced");
            return self.forward_unfenced(req).await;
        }
        let token_unchecked = kind == "read" && crate::mutants::active("unfenced_reads");
        if token_unchecked || !req.headers().contains_key(TOKEN_HEADER) {
            if !token_unchecked && (kind == "write" || self.require_token_for_reads) {
                return self.refuse(
                    &req,
                    kind,
                    "missing_token",
                    ApiError::new(
                        StatusCode::PRECONDITION_REQUIRED,
                        "fencing_token_required",
                        "this request needs a Fencing-Token header (send it through the fencer sidecar's proxy); every method outside gateway.read_methods is a write",
                    ),
                );
            }
            // Nothing was checked: nothing of ours goes to the storage.
            headers::strip_fencing(req.headers_mut(), &[]);
            self.count("none", kind, "unchecked");
            return self.forward_unfenced(req).await;
        }
        // The check: the token verified here, its fence admitted by
        // `fenced` (the span ends once the storage may be written).
        let check = crate::telemetry::spans::internal("gateway.check");
        let verified = check.in_scope(|| {
            self.normalize_path(&mut req)?;
            self.verify(&req)
        });
        let claim = match verified {
            Ok(c) => c,
            Err((result, err)) => {
                check.record("fencer.outcome", result);
                return self.refuse(&req, kind, result, err);
            }
        };
        crate::telemetry::spans::lock(&claim.key, Some(claim.token));
        // A read lease shares its key with other readers: its token may
        // read, never write — checked before the store is asked, so a
        // refused write moves no mark.
        if claim.mode == crate::token::Mode::Read
            && kind != "read"
            && !crate::mutants::active("read_token_writes")
        {
            check.record("fencer.outcome", "read_lease");
            tracing::warn!(
                key = %claim.key, token = claim.token, lease_tag = %claim.lease,
                method = %req.method(), "write under a read lease refused"
            );
            return self.refuse(
                &req,
                kind,
                "read_lease",
                ApiError::new(
                    StatusCode::CONFLICT,
                    "read_lease",
                    format!(
                        "token {} for `{}` is a read lease's: readers share the key and may not write (acquire it with \"mode\": \"write\")",
                        claim.token, claim.key
                    ),
                )
                .with("key", claim.key.as_str())
                .with("token", claim.token),
            );
        }
        let seq = match super::verify::sequence(&req) {
            Ok(s) => s,
            Err(e) => return self.refuse(&req, kind, "invalid_sequence", e),
        };
        // The storage gets the checked token and sequence (a storage may
        // record or check them: the demo storage's write log, an audit
        // trail) and none of the other `Fencing-*` headers: `Fencing-Key`
        // only repeats the token's key, and `Fencing-Lease`/`Fencing-Lock`
        // are the proxy's business.
        headers::strip_fencing(req.headers_mut(), &[TOKEN_HEADER, SEQ_HEADER]);
        super::fenced::forward(self, req, claim, seq, kind, check).await
    }

    /// Forwards a request that needs no fencing (reads without a token, or
    /// everything with enforcement off): nothing to hold.
    async fn forward_unfenced(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let started = Instant::now();
        let sending = self.forwarder.forward(req.map(stream));
        let result = crate::telemetry::spans::forwarded("gateway.forward", sending).await;
        let elapsed = started.elapsed().as_secs_f64();
        match result {
            Ok(resp) => {
                self.metrics
                    .upstream_duration
                    .with_label_values(&["ok"])
                    .observe(elapsed);
                super::fenced::storage_answer(resp)
            }
            Err(e) => {
                self.metrics
                    .upstream_duration
                    .with_label_values(&[e.outcome()])
                    .observe(elapsed);
                tracing::warn!(error = %e, "upstream request failed");
                e.to_response()
            }
        }
    }
}
