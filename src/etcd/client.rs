//! One etcd cluster, as its members' JSON gateways: every call bounded by
//! a deadline, sent to the member that answered last and, when it cannot
//! serve, to the next one — only where that is safe (see [`Retry`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::time::Instant;

pub use super::error::EtcdError;
use super::watch::Watch;
use super::wire::{
    b64, first_of, prefix_end, Compare, DeleteResponse, ErrorBody, KeepAliveResponse,
    LeaseGrantResponse, LeaseTimeToLiveResponse, Op, PutResponse, RangeResponse, TxnResponse,
};
use crate::http::tls_client::{Connector, Link, UpstreamTls};

/// The largest answer read (a range is bounded by its `limit`; this
/// bounds a misbehaving member).
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// gRPC status codes the gateway answers with.
const UNAVAILABLE: i32 = 14;
const DEADLINE_EXCEEDED: i32 = 4;
const UNAUTHENTICATED: i32 = 16;

/// The TLS link's label and settings table, named in errors and metrics.
pub const LINK: Link = Link {
    label: "etcd",
    field: "backend.etcd.tls",
};

/// Whether a call may go to the next member after one that may have
/// received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Reads, and writes that mean the same when applied twice (a delete,
    /// a compare-and-swap whose comparison fails the second time).
    Idempotent,
    /// Only when the request surely never left (no connection): anything
    /// else, and the caller is told the outcome is unknown.
    Once,
}

/// A user of etcd's authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `http://host:port` or `https://host:port` of each member.
    pub endpoints: Vec<String>,
    pub connect_timeout: Duration,
    pub credentials: Option<Credentials>,
    pub tls: UpstreamTls,
}

pub struct EtcdClient {
    endpoints: Vec<Uri>,
    /// The member that answered last: calls start there.
    preferred: AtomicUsize,
    http: Client<Connector, Full<Bytes>>,
    credentials: Option<Credentials>,
    /// The auth token in use (`authenticate`), renewed when a member says
    /// it is no longer valid.
    token: Mutex<Option<String>>,
}

/// What one member did with one request.
enum Sent {
    /// It answered: status and body.
    Answer(u16, Bytes),
    /// The request never left (no connection).
    NeverLeft(String),
    /// It may have arrived; no answer.
    Lost(String),
}

impl EtcdClient {
    pub fn new(config: &ClientConfig) -> Result<EtcdClient, String> {
        if config.endpoints.is_empty() {
            return Err("no etcd endpoint".into());
        }
        let endpoints = config
            .endpoints
            .iter()
            .map(|e| {
                let uri: Uri = e.parse().map_err(|err| format!("endpoint {e:?}: {err}"))?;
                match (uri.scheme_str(), uri.authority()) {
                    (Some("http" | "https"), Some(_)) => Ok(uri),
                    _ => Err(format!("endpoint {e:?}: not http(s)://host:port")),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let scheme = endpoints[0].scheme_str().unwrap_or("http");
        if endpoints.iter().any(|u| u.scheme_str() != Some(scheme)) {
            return Err("etcd endpoints mix http and https".into());
        }
        let connector = Connector::new(LINK, scheme, &config.tls, config.connect_timeout)?;
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_timer(TokioTimer::new())
            .build(connector);
        Ok(EtcdClient {
            endpoints,
            preferred: AtomicUsize::new(0),
            http,
            credentials: config.credentials.clone(),
            token: Mutex::new(None),
        })
    }

    /// Reads `key`.
    pub async fn get(&self, key: &[u8], deadline: Instant) -> Result<RangeResponse, EtcdError> {
        self.call(
            "/v3/kv/range",
            json!({"key": b64(key)}),
            deadline,
            Retry::Idempotent,
        )
        .await
    }

    /// The keys under `prefix` created at or before `max_create_revision`
    /// (0: any), by creation revision, newest first, at most `limit` (0:
    /// all). The lock recipe's "who is just ahead of me".
    pub async fn newest_before(
        &self,
        prefix: &[u8],
        max_create_revision: i64,
        limit: i64,
        deadline: Instant,
    ) -> Result<RangeResponse, EtcdError> {
        let mut body = json!({
            "key": b64(prefix),
            "range_end": b64(&prefix_end(prefix)),
            "sort_order": "DESCEND",
            "sort_target": "CREATE",
            "limit": limit.to_string(),
        });
        if max_create_revision > 0 {
            body["max_create_revision"] = json!(max_create_revision.to_string());
        }
        self.call("/v3/kv/range", body, deadline, Retry::Idempotent)
            .await
    }

    pub async fn put(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        deadline: Instant,
    ) -> Result<PutResponse, EtcdError> {
        let mut body = json!({"key": b64(key), "value": b64(value)});
        if lease != 0 {
            body["lease"] = json!(lease.to_string());
        }
        self.call("/v3/kv/put", body, deadline, Retry::Once).await
    }

    pub async fn delete(&self, key: &[u8], deadline: Instant) -> Result<DeleteResponse, EtcdError> {
        self.call(
            "/v3/kv/deleterange",
            json!({"key": b64(key)}),
            deadline,
            Retry::Idempotent,
        )
        .await
    }

    /// Runs `success` if every comparison holds, else `failure`, at one
    /// revision.
    pub async fn txn(
        &self,
        compare: &[Compare],
        success: &[Op],
        failure: &[Op],
        deadline: Instant,
        retry: Retry,
    ) -> Result<TxnResponse, EtcdError> {
        let ops = |ops: &[Op]| ops.iter().map(Op::json).collect::<Vec<_>>();
        let body = json!({
            "compare": compare.iter().map(Compare::json).collect::<Vec<_>>(),
            "success": ops(success),
            "failure": ops(failure),
        });
        self.call("/v3/kv/txn", body, deadline, retry).await
    }

    /// A lease of `ttl` (whole seconds, at least one: etcd's unit).
    ///
    /// Sent on to the next member like a read when one does not answer: a
    /// grant applied twice leaves one lease unused, with no key on it, to
    /// lapse at its TTL — while waiting out a member that lost its leader
    /// took an acquire's whole budget at every leader kill.
    pub async fn grant(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<LeaseGrantResponse, EtcdError> {
        let secs = ttl.as_secs().max(1);
        self.call(
            "/v3/lease/grant",
            json!({"TTL": secs.to_string()}),
            deadline,
            Retry::Idempotent,
        )
        .await
    }

    /// One keepalive of lease `id`: its TTL again, or 0 if it is gone.
    pub async fn keep_alive(
        &self,
        id: i64,
        deadline: Instant,
    ) -> Result<KeepAliveResponse, EtcdError> {
        let v: Value = self
            .call(
                "/v3/lease/keepalive",
                json!({"ID": id.to_string()}),
                deadline,
                Retry::Idempotent,
            )
            .await?;
        serde_json::from_value(v["result"].clone())
            .map_err(|e| EtcdError::Protocol(format!("keepalive answer: {e}")))
    }

    /// What lease `id` has left (a read: sent on to the next member).
    pub async fn time_to_live(
        &self,
        id: i64,
        deadline: Instant,
    ) -> Result<LeaseTimeToLiveResponse, EtcdError> {
        self.call(
            "/v3/lease/timetolive",
            json!({"ID": id.to_string()}),
            deadline,
            Retry::Idempotent,
        )
        .await
    }

    /// Ends lease `id` and deletes every key attached to it.
    pub async fn revoke(&self, id: i64, deadline: Instant) -> Result<(), EtcdError> {
        let done: Result<Value, _> = self
            .call(
                "/v3/lease/revoke",
                json!({"ID": id.to_string()}),
                deadline,
                Retry::Idempotent,
            )
            .await;
        match done {
            Ok(_) => Ok(()),
            // Gone already (expired, or an earlier try of this revoke).
            Err(EtcdError::Rejected { message, .. }) if message.contains("lease not found") => {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Watches `key` from `start_revision` (0: from now). The stream is
    /// opened within `deadline`; its events come as they happen, for as
    /// long as the caller reads them (dropping it closes it).
    pub async fn watch(
        &self,
        key: &[u8],
        start_revision: i64,
        deadline: Instant,
    ) -> Result<Watch, EtcdError> {
        self.watch_range(key, None, start_revision, deadline).await
    }

    /// The key under `prefix` with the lowest creation revision, and how
    /// many keys are under it.
    pub async fn first(
        &self,
        prefix: &[u8],
        deadline: Instant,
    ) -> Result<RangeResponse, EtcdError> {
        self.call(
            "/v3/kv/range",
            first_of(prefix),
            deadline,
            Retry::Idempotent,
        )
        .await
    }

    /// Watches every key under `prefix`, as [`EtcdClient::watch`].
    pub async fn watch_prefix(
        &self,
        prefix: &[u8],
        start_revision: i64,
        deadline: Instant,
    ) -> Result<Watch, EtcdError> {
        self.watch_range(prefix, Some(&prefix_end(prefix)), start_revision, deadline)
            .await
    }

    async fn watch_range(
        &self,
        key: &[u8],
        range_end: Option<&[u8]>,
        start_revision: i64,
        deadline: Instant,
    ) -> Result<Watch, EtcdError> {
        let mut create = json!({"key": b64(key)});
        if let Some(end) = range_end {
            create["range_end"] = json!(b64(end));
        }
        if start_revision > 0 {
            create["start_revision"] = json!(start_revision.to_string());
        }
        let body = json!({ "create_request": create }).to_string();
        let n = self.endpoints.len();
        let start = self.preferred.load(Ordering::Relaxed);
        let mut last = String::from("no member tried");
        for i in 0..n {
            let at = (start + i) % n;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let request = self.request(at, "/v3/watch", body.clone())?;
            match tokio::time::timeout(left, self.http.request(request)).await {
                Ok(Ok(resp)) if resp.status() == 200 => {
                    let mut watch = Watch::new(resp.into_body());
                    // The first message says the watch exists.
                    match tokio::time::timeout(left, watch.next()).await {
                        Ok(Ok(first)) if first.created => {
                            self.preferred.store(at, Ordering::Relaxed);
                            return Ok(watch);
                        }
                        Ok(Ok(other)) => {
                            return Err(EtcdError::Protocol(format!(
                                "a watch's first message: {other:?}"
                            )))
                        }
                        Ok(Err(e)) => last = e.to_string(),
                        Err(_) => last = "no answer to the watch".into(),
                    }
                }
                Ok(Ok(resp)) => {
                    let status = resp.status().as_u16();
                    let body = read(resp.into_body()).await.unwrap_or_default();
                    match self.failure(status, &body) {
                        Failure::NextMember(why) => last = why,
                        Failure::Final(e) => return Err(e),
                    }
                }
                Ok(Err(e)) => last = crate::error_chain::chain(&e),
                Err(_) => last = "no answer to the watch".into(),
            }
        }
        Err(EtcdError::Unavailable(format!("watch: {last}")))
    }

    /// Sends `body` to `path`, starting at the member that answered last;
    /// the answer parsed as `T`.
    pub async fn call<T: DeserializeOwned>(
        &self,
        path: &str,
        body: Value,
        deadline: Instant,
        retry: Retry,
    ) -> Result<T, EtcdError> {
        let body = body.to_string();
        let n = self.endpoints.len();
        let start = self.preferred.load(Ordering::Relaxed);
        let mut last = String::from("no member tried: the deadline had passed");
        let mut reauthenticated = false;
        let mut i = 0;
        while i < n {
            let at = (start + i) % n;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // A call that may go on gives each member left its share, so a
            // frozen member cannot take the whole budget.
            let left = match retry {
                Retry::Idempotent => left / (n - i) as u32,
                Retry::Once => left,
            };
            let sent = match tokio::time::timeout(left, self.send(at, path, body.clone())).await {
                Ok(sent) => sent?,
                Err(_) => Sent::Lost(format!("no answer within {left:?}")),
            };
            match sent {
                Sent::Answer(200, bytes) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    return serde_json::from_slice(&bytes)
                        .map_err(|e| EtcdError::Protocol(format!("{path}: {e}")));
                }
                Sent::Answer(status, bytes) => match self.failure(status, &bytes) {
                    Failure::Final(EtcdError::Rejected { code, .. })
                        if code == UNAUTHENTICATED && !reauthenticated =>
                    {
                        // The token expired: a new one, then the same member.
                        *self.token.lock().expect("token") = None;
                        reauthenticated = true;
                        continue;
                    }
                    Failure::Final(e) => return Err(e),
                    Failure::NextMember(why) if retry == Retry::Idempotent => last = why,
                    Failure::NextMember(why) => {
                        return Err(EtcdError::Unavailable(format!("{path}: {why}")))
                    }
                },
                Sent::NeverLeft(why) => last = why,
                Sent::Lost(why) if retry == Retry::Idempotent => last = why,
                Sent::Lost(why) => {
                    return Err(EtcdError::Unavailable(format!(
                        "{path}: {why} (the outcome is unknown)"
                    )))
                }
            }
            i += 1;
        }
        Err(EtcdError::Unavailable(format!("{path}: {last}")))
    }

    /// What a non-200 answer means.
    fn failure(&self, status: u16, body: &[u8]) -> Failure {
        let e: ErrorBody = serde_json::from_slice(body).unwrap_or_else(|_| ErrorBody {
            code: 0,
            message: String::from_utf8_lossy(body).chars().take(200).collect(),
        });
        // A member that cannot serve now: another may.
        let transient = e.code == UNAVAILABLE
            || e.code == DEADLINE_EXCEEDED
            || status >= 502
            || e.message.contains("no leader")
            || e.message.contains("leader changed")
            || e.message.contains("timed out");
        if transient {
            Failure::NextMember(format!("{status} {}", e.message))
        } else {
            Failure::Final(EtcdError::Rejected {
                code: e.code,
                message: e.message,
            })
        }
    }

    /// One request to member `at`, authenticated when credentials are set.
    async fn send(&self, at: usize, path: &str, body: String) -> Result<Sent, EtcdError> {
        let mut request = self.request(at, path, body)?;
        if let Some(token) = self.token(at).await? {
            request.headers_mut().insert(
                "authorization",
                token
                    .parse()
                    .map_err(|_| EtcdError::Protocol("an auth token that is no header".into()))?,
            );
        }
        Ok(match self.http.request(request).await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                match read(resp.into_body()).await {
                    Ok(bytes) => Sent::Answer(status, bytes),
                    Err(e) => Sent::Lost(e),
                }
            }
            Err(e) if e.is_connect() => Sent::NeverLeft(crate::error_chain::chain(&e)),
            Err(e) => Sent::Lost(crate::error_chain::chain(&e)),
        })
    }

    fn request(
        &self,
        at: usize,
        path: &str,
        body: String,
    ) -> Result<hyper::Request<Full<Bytes>>, EtcdError> {
        let base = &self.endpoints[at];
        let uri = format!(
            "{}://{}{path}",
            base.scheme_str().unwrap_or("http"),
            base.authority().map_or("", |a| a.as_str())
        );
        hyper::Request::post(uri)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| EtcdError::Protocol(e.to_string()))
    }

    /// The auth token, fetched from member `at` when there is none yet.
    async fn token(&self, at: usize) -> Result<Option<String>, EtcdError> {
        let Some(c) = &self.credentials else {
            return Ok(None);
        };
        if let Some(t) = self.token.lock().expect("token").clone() {
            return Ok(Some(t));
        }
        let body = json!({"name": c.user, "password": c.password}).to_string();
        let request = self.request(at, "/v3/auth/authenticate", body)?;
        let resp = self
            .http
            .request(request)
            .await
            .map_err(|e| EtcdError::Unavailable(crate::error_chain::chain(&e)))?;
        let status = resp.status().as_u16();
        let bytes = read(resp.into_body())
            .await
            .map_err(EtcdError::Unavailable)?;
        if status != 200 {
            return Err(match self.failure(status, &bytes) {
                Failure::Final(e) => e,
                Failure::NextMember(why) => EtcdError::Unavailable(why),
            });
        }
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| EtcdError::Protocol(format!("authenticate: {e}")))?;
        let token = v["token"]
            .as_str()
            .ok_or_else(|| EtcdError::Protocol("authenticate: no token".into()))?
            .to_owned();
        *self.token.lock().expect("token") = Some(token.clone());
        Ok(Some(token))
    }
}

enum Failure {
    NextMember(String),
    Final(EtcdError),
}

/// A whole (bounded) answer body.
async fn read(body: Incoming) -> Result<Bytes, String> {
    Limited::new(body, MAX_ANSWER_BYTES)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| format!("reading the answer: {e}"))
}
