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
use hyper::Method;

use super::api_conn::ApiConn;
use super::local::{self, Proc};
use super::stats::Report;

/// The processes of the write path.
pub struct Stack {
    pub storage: String,
    pub nginx: Option<String>,
    pub proxy: String,
    pub api: String,
    _procs: Vec<Proc>,
}

impl Stack {
    pub async fn start() -> Result<Stack, String> {
        let storage_port = local::free_port()?;
        let storage_addr = format!("127.0.0.1:{storage_port}");
        let storage = local::fencer(
            "storage",
            &[
                ("storage.listen", storage_addr.clone()),
                ("storage.backend", "memory".into()),
            ],
            &storage_addr,
        )
        .await?;
        let gateway_addr = format!("127.0.0.1:{}", local::free_port()?);
        let gateway = local::fencer(
            "gateway",
            &[
                ("gateway.listen", gateway_addr.clone()),
                ("gateway.upstream", format!("http://{storage_addr}")),
                ("gateway.fence_store", "memory".into()),
                ("admin.listen", format!("127.0.0.1:{}", local::free_port()?)),
            ],
            &gateway_addr,
        )
        .await?;
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
        let mut procs = vec![storage, gateway, sidecar];
        let nginx = match local::nginx(nginx_port, storage_port).await {
            Ok(p) => {
                procs.push(p);
                Some(format!("http://127.0.0.1:{nginx_port}"))
            }
            Err(e) => {
                eprintln!("fencer bench: nginx comparison skipped: {e}");
                None
            }
        };
        Ok(Stack {
            storage: format!("http://{storage_addr}"),
            nginx,
            proxy: format!("http://{proxy_addr}"),
            api: format!("http://{api_addr}"),
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

/// `clients` writers, each PUTting to its own key for `secs`.
pub async fn run_path(
    stack: &Stack,
    path: Path,
    clients: usize,
    secs: u64,
) -> Result<Report, String> {
    let base = match path {
        Path::Direct => stack.storage.clone(),
        Path::Nginx => stack.nginx.clone().ok_or("nginx is not running")?,
        Path::Fenced => stack.proxy.clone(),
    };
    let tag = rand::random::<u32>();
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (base, api) = (base.clone(), stack.api.clone());
            tokio::spawn(async move {
                let lock = format!("wp:{tag}:{c}");
                if path == Path::Fenced {
                    // Held for the whole run; the proxy finds it by name.
                    let mut conn = ApiConn::new(&api);
                    let (status, body) = conn
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
                }
                let mut conn = ApiConn::new(&base);
                let uri = format!("/kv/bench/{tag}/{c}");
                let headers: Vec<(&str, &str)> = match path {
                    Path::Fenced => vec![("fencing-lock", lock.as_str())],
                    _ => Vec::new(),
                };
                let mut r = Report::default();
                let mut n = 0u64;
                while Instant::now() < until {
                    n += 1;
                    let t0 = Instant::now();
                    match conn
                        .send(Method::PUT, &uri, &headers, Bytes::from(n.to_string()))
                        .await
                    {
                        Ok((200..=299, _)) => r.record(Duration::ZERO, t0.elapsed()),
                        Ok((status, body)) => {
                            return Err(format!(
                                "{} write refused: {status} {}",
                                path.label(),
                                String::from_utf8_lossy(&body)
                            ))
                        }
                        Err(_) => r.errors += 1,
                    }
                }
                Ok(r)
            })
        })
        .collect();
    let started = Instant::now();
    let mut total = Report::default();
    for t in tasks {
        total.absorb(t.await.map_err(|e| e.to_string())??);
    }
    total.secs = started.elapsed().as_secs_f64();
    total.sort();
    Ok(total)
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
