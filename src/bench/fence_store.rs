//! The PostgreSQL fence-store scenario: fenced writes per second through a
//! gateway whose marks live in PostgreSQL, against the same writes sent
//! straight to the storage in the same run.
//!
//! Clients sign their own tokens with the gateway's secret (as the proxy
//! would) and every write carries a new, higher token for its key, so each
//! one moves a mark in PostgreSQL — the store's most expensive case.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::api_conn::ApiConn;
use super::local::{self, Proc};
use super::stats::Report;
use crate::lock::LeaseId;
use crate::token::{Claim, Signer};

pub struct Stack {
    pub storage: String,
    pub gateway: String,
    /// The gateway's admin listener (its metrics).
    admin: String,
    _procs: Vec<Proc>,
}

impl Stack {
    pub async fn start(postgres_url: &str) -> Result<Stack, String> {
        let (storage_port, gateway_addr, admin, procs) = local::storage_and_gateway(&[
            ("gateway.fence_store", "postgres".into()),
            ("gateway.postgres_url", postgres_url.into()),
        ])
        .await?;
        Ok(Stack {
            storage: format!("http://127.0.0.1:{storage_port}"),
            gateway: format!("http://{gateway_addr}"),
            admin: format!("http://{admin}"),
            _procs: procs,
        })
    }

    /// Calls per statement so far, by op (`admit`, `finish`): `(statements,
    /// calls)` from the gateway's `fencer_gateway_fence_items_per_statement`
    /// — how much the group commit shared.
    pub async fn items_per_statement(&self) -> Result<Vec<(String, f64, f64)>, String> {
        let mut conn = ApiConn::new(&self.admin);
        let (status, body) = conn
            .send(hyper::Method::GET, "/metrics", &[], Bytes::new())
            .await?;
        if status != 200 {
            return Err(format!("gateway metrics answered {status}"));
        }
        let text = String::from_utf8_lossy(&body);
        let name = "fencer_gateway_fence_items_per_statement";
        let value = |suffix: &str, op: &str| {
            text.lines()
                .filter(|l| l.starts_with(&format!("{name}_{suffix}{{")))
                .filter(|l| l.contains(&format!("op=\"{op}\"")))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        };
        Ok(["admit", "finish"]
            .iter()
            .map(|op| (op.to_string(), value("count", op), value("sum", op)))
            .collect())
    }
}

/// `clients` writers, each on its own key, for `secs`; `fenced` sends them
/// through the gateway with a fresh token each, otherwise straight to the
/// storage.
pub async fn run(stack: &Stack, fenced: bool, clients: usize, secs: u64) -> Result<Report, String> {
    let base = if fenced {
        stack.gateway.clone()
    } else {
        stack.storage.clone()
    };
    let tag = rand::random::<u32>();
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let base = base.clone();
            tokio::spawn(async move {
                let signer = Signer::new("k1", local::SECRET.as_bytes());
                let key = format!("fs:{tag}:{c}");
                let lease = LeaseId::generate();
                let mut conn = ApiConn::new(&base);
                let uri = format!("/kv/fence-bench/{tag}/{c}");
                let mut r = Report::default();
                let mut token = 0u64;
                while Instant::now() < until {
                    token += 1;
                    let wire = signer.sign(&Claim::new(&key, token, lease.as_str()));
                    let headers: Vec<(&str, &str)> = if fenced {
                        vec![
                            ("fencing-key", key.as_str()),
                            ("fencing-token", wire.as_str()),
                        ]
                    } else {
                        Vec::new()
                    };
                    conn.put_timed(
                        &uri,
                        &headers,
                        Bytes::from(token.to_string()),
                        &mut r,
                        "fenced",
                    )
                    .await?;
                }
                Ok(r)
            })
        })
        .collect();
    super::stats::join(tasks, Instant::now()).await
}
