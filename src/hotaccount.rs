//! The hot-account workload from the seeds: many workers increment one
//! balance with lock → read → +1 → write → release. Without fencing, a
//! worker that pauses past its lease writes a balance computed from a stale
//! read and increments are lost; with fencing, that write is refused.
//!
//! Used by `fencer demo` (in-process workers with simulated pauses) and by
//! `fencer hot-account-worker` (a real process that a test SIGSTOPs).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

/// How a worker reaches the storage.
#[derive(Debug, Clone, PartialEq, Eq, clap::ValueEnum)]
pub enum Via {
    /// Straight to the storage: the lock alone protects the data.
    Direct,
    /// To the gateway, carrying the signed token itself (the seeds' story).
    Gateway,
    /// Through the sidecar's egress proxy, which adds the token.
    Proxy,
}

#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The sidecar's lock API.
    #[arg(long)]
    pub api: String,
    /// Base URL for storage requests (storage, gateway or proxy per --via).
    #[arg(long)]
    pub target: String,
    #[arg(long, value_enum)]
    pub via: Via,
    #[arg(long, default_value = "account:hot")]
    pub key: String,
    #[arg(long, default_value = "accounts/hot")]
    pub path: String,
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub ttl_ms: u64,
    /// Cycles to run.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub cycles: u64,
    /// Read from here, without any fencing header (write-only fencing, for
    /// comparison). Default: read the way writes go.
    #[arg(long)]
    pub read_target: Option<String>,
    /// Time between read and write (the "computation"), in ms.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub think_ms: u64,
}

/// What happened to one cycle's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteResult {
    Accepted,
    /// Refused by the gateway: a newer token was accepted for the key.
    Stale,
    /// Refused by the sidecar: this worker's lease is lost.
    LeaseLost,
    /// Lock not acquired, read refused, or an error.
    Skipped,
}

pub struct Worker {
    client: Client<HttpConnector, Full<Bytes>>,
    pub args: WorkerArgs,
}

struct Lease {
    lease_id: String,
    token: u64,
    fencing_token: String,
}

impl Worker {
    pub fn new(args: WorkerArgs) -> Worker {
        Worker {
            client: Client::builder(TokioExecutor::new()).build_http(),
            args,
        }
    }

    async fn call(
        &self,
        method: hyper::Method,
        url: String,
        headers: &[(&str, String)],
        body: Option<Value>,
    ) -> Result<(u16, Value), String> {
        let mut req = hyper::Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, v.as_str());
        }
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = req
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(30), self.client.request(req))
            .await
            .map_err(|_| "timeout".to_string())?
            .map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    fn key_path(&self) -> String {
        percent_encoding::utf8_percent_encode(&self.args.key, percent_encoding::NON_ALPHANUMERIC)
            .to_string()
    }

    async fn acquire(&self) -> Option<Lease> {
        let url = format!("{}/v1/locks/{}/acquire", self.args.api, self.key_path());
        let body = json!({"ttl_ms": self.args.ttl_ms, "wait_ms": 30_000});
        match self.call(hyper::Method::POST, url, &[], Some(body)).await {
            Ok((200, v)) => Some(Lease {
                lease_id: v["lease_id"].as_str()?.to_owned(),
                token: v["token"].as_u64()?,
                fencing_token: v["fencing_token"].as_str()?.to_owned(),
            }),
            _ => None,
        }
    }

    async fn release(&self, lease: &Lease) {
        let url = format!("{}/v1/locks/{}/release", self.args.api, self.key_path());
        let _ = self
            .call(
                hyper::Method::POST,
                url,
                &[],
                Some(json!({"lease_id": lease.lease_id})),
            )
            .await;
    }

    fn headers(&self, lease: &Lease) -> Vec<(&'static str, String)> {
        match self.args.via {
            Via::Direct => vec![],
            Via::Gateway => vec![("fencing-token", lease.fencing_token.clone())],
            Via::Proxy => vec![
                ("fencing-lock", self.args.key.clone()),
                ("fencing-lease", lease.lease_id.clone()),
            ],
        }
    }

    /// One lock → read → `between` → write → release cycle. Returns the
    /// write's fate and the lease's token.
    pub async fn cycle<F: std::future::Future<Output = ()>>(
        &self,
        between: impl FnOnce(u64) -> F,
    ) -> (WriteResult, u64) {
        let Some(lease) = self.acquire().await else {
            return (WriteResult::Skipped, 0);
        };
        let url = format!("{}/kv/{}", self.args.target, self.args.path);
        let headers = self.headers(&lease);
        let balance = match self
            .call(hyper::Method::GET, url.clone(), &headers, None)
            .await
        {
            Ok((200, v)) => v["value"]["balance"].as_i64().unwrap_or(0),
            Ok((404, _)) => 0,
            _ => {
                self.release(&lease).await;
                return (WriteResult::Skipped, lease.token);
            }
        };
        between(lease.token).await;
        let result = match self
            .call(
                hyper::Method::PUT,
                url,
                &headers,
                Some(json!({"balance": balance + 1})),
            )
            .await
        {
            Ok((200, _)) => WriteResult::Accepted,
            Ok((409, v)) if v["error"] == "stale_fencing_token" => WriteResult::Stale,
            Ok((409, v)) if v["error"] == "lease_lost" => WriteResult::LeaseLost,
            _ => WriteResult::Skipped,
        };
        self.release(&lease).await;
        (result, lease.token)
    }

    /// Reads the balance straight from the storage.
    pub async fn balance(&self, storage: &str) -> i64 {
        let url = format!("{storage}/kv/{}", self.args.path);
        match self.call(hyper::Method::GET, url, &[], None).await {
            Ok((200, v)) => v["value"]["balance"].as_i64().unwrap_or(0),
            _ => 0,
        }
    }
}

/// `fencer hot-account-worker`: runs cycles and prints one line per event
/// (`READ <token>` right before the think time, `WRITE <result> <token>`),
/// so a controller can pause it between read and write.
pub async fn run_worker(args: WorkerArgs) {
    let think = Duration::from_millis(args.think_ms);
    let cycles = args.cycles;
    let worker = Worker::new(args);
    for _ in 0..cycles {
        let (result, token) = worker
            .cycle(|token| async move {
                crate::outln!("READ {token}");
                tokio::time::sleep(think).await;
            })
            .await;
        let word = match result {
            WriteResult::Accepted => "accepted",
            WriteResult::Stale => "stale",
            WriteResult::LeaseLost => "lease_lost",
            WriteResult::Skipped => "skipped",
        };
        if !crate::outln!("WRITE {word} {token}") {
            // The controller reading these lines has gone.
            return;
        }
    }
}
