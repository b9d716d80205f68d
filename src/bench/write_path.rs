//! The write-path scenario: what the egress proxy plus the gateway add to a
//! storage write, side by side with an nginx reverse proxy in front of the
//! same upstream and with a direct request, in the same run.
//!
//! Started here, each as its own process on loopback: `fencer storage`
//! (memory), `fencer gateway` (memory fence store), `fencer sidecar`
//! (memory lock backend, proxy on), and nginx (one worker, upstream
//! keep-alive). Every fenced write is a real one: the client holds the
//! lock, the proxy injects the signed token, the gateway checks it against
//! the key's mark and forwards.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::api_conn::ApiConn;
use super::local::{self, Proc};
use super::stats::Report;

/// The processes of the write path.
pub struct Stack {
    pub storage: String,
    pub nginx: Option<String>,
    pub proxy: String,
    pub api: String,
    /// (role, pid) of every process, for CPU per write.
    pub pids: Vec<(&'static str, u32)>,
    _procs: Vec<Proc>,
}

impl Stack {
    pub async fn start() -> Result<Stack, String> {
        let (storage_port, gateway_addr, _admin, base) =
            local::storage_and_gateway(&[("gateway.fence_store", "memory".into())]).await?;
        let storage_addr = format!("127.0.0.1:{storage_port}");
        let api_addr = format!("127.0.0.1:{}", local::free_port()?);
        let proxy_addr = format!("127.0.0.1:{}", local::free_port()?);
        let sidecar = local::fencer(
            "sidecar",
            &[
                ("sidecar.listen", api_addr.clone()),
                ("proxy.enabled", "true".into()),
                ("proxy.listen", proxy_addr.clone()),
                ("proxy.upstream", format!("http://{gateway_addr}")),
                ("backend.kind", "memory".into()),
                ("admin.listen", format!("127.0.0.1:{}", local::free_port()?)),
            ],
            &api_addr,
        )
        .await?;
        let nginx_port = local::free_port()?;
        let mut pids = vec![
            ("storage", base[0].pid()),
            ("gateway", base[1].pid()),
            ("proxy", sidecar.pid()),
        ];
        let mut procs = base;
        procs.push(sidecar);
        let nginx = match local::nginx(nginx_port, storage_port).await {
            Ok(p) => {
                pids.push(("nginx", p.pid()));
                procs.push(p);
                Some(format!("http://127.0.0.1:{nginx_port}"))
            }
            Err(e) => {
                crate::errln!("fencer bench: nginx comparison skipped: {e}");
                None
            }
        };
        Ok(Stack {
            storage: format!("http://{storage_addr}"),
            nginx,
            proxy: format!("http://{proxy_addr}"),
            api: format!("http://{api_addr}"),
            pids,
            _procs: procs,
        })
    }
}

/// Where a write goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Direct,
    Nginx,
    Fenced,
}

impl Path {
    pub fn label(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Nginx => "nginx",
            Path::Fenced => "fencer",
        }
    }
}

/// One writer on one path: its own keep-alive connection and key.
struct Writer {
    path: Path,
    conn: ApiConn,
    uri: String,
    /// The lease the fenced path writes under (the proxy finds the key).
    lease: Option<String>,
    n: u64,
}

impl Writer {
    /// For `path`, writing `/kv/bench/<tag>/<c>`; on the fenced path it first
    /// acquires (for the whole run) a lock and writes under its lease.
    async fn new(stack: &Stack, path: Path, tag: u32, c: usize) -> Result<Writer, String> {
        let base = match path {
            Path::Direct => stack.storage.clone(),
            Path::Nginx => stack.nginx.clone().ok_or("nginx is not running")?,
            Path::Fenced => stack.proxy.clone(),
        };
        let lease = if path == Path::Fenced {
            let lock = format!("wp:{tag}:{c}");
            let (status, body) = ApiConn::new(&stack.api)
                .post_json(
                    &format!("/v1/locks/{lock}/acquire"),
                    r#"{"ttl_ms":3600000}"#.into(),
                )
                .await?;
            if status != 200 {
                return Err(format!(
                    "acquire for the write path: {status} {}",
                    String::from_utf8_lossy(&body)
                ));
            }
            let v: serde_json::Value =
                serde_json::from_slice(&body).map_err(|e| format!("acquire answer: {e}"))?;
            Some(
                v["lease_id"]
                    .as_str()
                    .ok_or("acquire answer without lease_id")?
                    .to_owned(),
            )
        } else {
            None
        };
        Ok(Writer {
            path,
            conn: ApiConn::new(&base),
            uri: format!("/kv/bench/{tag}/{c}"),
            lease,
            n: 0,
        })
    }

    /// One PUT; records its latency (or an error) in `r`.
    async fn write(&mut self, r: &mut Report) -> Result<(), String> {
        self.n += 1;
        let headers: &[(&str, &str)] = match &self.lease {
            Some(lease) => &[("fencing-lease", lease.as_str())],
            None => &[],
        };
        self.conn
            .put_timed(
                &self.uri,
                headers,
                Bytes::from(self.n.to_string()),
                r,
                self.path.label(),
            )
            .await
    }
}

/// One client alternating between `paths` in batches of 20 writes for
/// `secs`, so that the machine's drift (this machine's noise is larger than
/// the differences measured) hits every path alike. Returns one report per
/// path, each timed by the time spent on that path.
pub async fn run_interleaved(
    stack: &Stack,
    paths: &[Path],
    secs: u64,
) -> Result<Vec<Report>, String> {
    let tag = rand::random::<u32>();
    let mut writers = Vec::new();
    for p in paths {
        writers.push(Writer::new(stack, *p, tag, 0).await?);
    }
    let mut reports = vec![Report::default(); paths.len()];
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        for (w, r) in writers.iter_mut().zip(reports.iter_mut()) {
            let t0 = Instant::now();
            for _ in 0..20 {
                w.write(r).await?;
            }
            r.secs += t0.elapsed().as_secs_f64();
        }
    }
    for r in &mut reports {
        r.per_client.push(r.cycles);
        r.sort();
    }
    Ok(reports)
}

/// `clients` writers, each PUTting to its own key for `secs`.
pub async fn run_path(
    stack: &Stack,
    path: Path,
    clients: usize,
    secs: u64,
) -> Result<Report, String> {
    let tag = rand::random::<u32>();
    let until = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mut w = Writer::new(stack, path, tag, c).await?;
        tasks.push(tokio::spawn(async move {
            let mut r = Report::default();
            while Instant::now() < until {
                w.write(&mut r).await?;
            }
            Ok::<Report, String>(r)
        }));
    }
    super::stats::join(tasks, Instant::now()).await
}

impl Stack {
    /// CPU seconds used so far by each process (with its children).
    pub fn cpu(&self) -> Vec<f64> {
        self.pids
            .iter()
            .map(|(_, pid)| local::tree_cpu_secs(*pid).unwrap_or(0.0))
            .collect()
    }

    /// "cpu µs per write" for the hop processes, from CPU snapshots taken
    /// around a measurement and the writes each path made.
    pub fn cpu_line(&self, before: &[f64], after: &[f64], writes: &[(Path, u64)]) -> String {
        let count = |p: Path| {
            writes
                .iter()
                .filter(|(q, _)| *q == p)
                .map(|(_, n)| *n)
                .sum::<u64>()
                .max(1) as f64
        };
        let all = writes.iter().map(|(_, n)| *n).sum::<u64>().max(1) as f64;
        let parts: Vec<String> = self
            .pids
            .iter()
            .enumerate()
            .map(|(i, (role, _))| {
                let n = match *role {
                    "nginx" => count(Path::Nginx),
                    "proxy" | "gateway" => count(Path::Fenced),
                    _ => all,
                };
                format!("{role} {:.1}", 1e6 * (after[i] - before[i]) / n)
            })
            .collect();
        format!("            cpu µs per write: {}", parts.join("  "))
    }
}

pub fn line(label: &str, r: &Report, direct_p50: f64) -> String {
    let p50 = Report::pct(&r.cycle_us, 0.5);
    format!(
        "  {label:<9} writes/s {:>9.0}  p50/p99/max ms {:>6.3}/{:>6.3}/{:>7.2}  added p50 ms {:>6.3}  errors {}",
        r.cycles_per_sec(),
        p50,
        Report::pct(&r.cycle_us, 0.99),
        Report::pct(&r.cycle_us, 1.0),
        p50 - direct_p50,
        r.errors
    )
}
