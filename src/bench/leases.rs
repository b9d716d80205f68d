//! The many-leases scenario: one sidecar holds N auto-renewed leases on
//! Redis; measured are its resident memory above idle, its CPU while it
//! keeps them all alive, and how many Redis commands the renewals cost
//! (they are batched: many leases per script call).

use std::time::{Duration, Instant};

use futures_util::StreamExt;

use super::api_conn::ApiConn;
use super::local::{self, Proc};

#[derive(Debug)]
pub struct LeaseReport {
    pub leases: usize,
    pub acquire_secs: f64,
    pub idle_rss_kib: u64,
    pub held_rss_kib: u64,
    pub window_secs: f64,
    pub cpu_secs: f64,
    pub renewals: f64,
    /// Script calls (round trips carrying renewals).
    pub redis_scripts: f64,
    /// Every command, including the ones inside scripts.
    pub redis_commands: f64,
    pub held_after: f64,
    pub lost: f64,
}

impl LeaseReport {
    pub fn lines(&self) -> String {
        let w = self.window_secs.max(1e-9);
        format!(
            "  leases {}  acquired in {:.1} s ({:.0}/s)\n  \
             rss idle {:.1} MB  with leases {:.1} MB  above idle {:.1} MB  ({:.0} bytes/lease)\n  \
             over {:.1} s: cpu {:.1}% of a core  renewals/s {:.0}  redis round trips/s {:.1} \
             (renewals per round trip {:.0})  redis commands/s incl. inside scripts {:.0}\n  \
             still held {}  lost {}",
            self.leases,
            self.acquire_secs,
            self.leases as f64 / self.acquire_secs.max(1e-9),
            self.idle_rss_kib as f64 / 1024.0,
            self.held_rss_kib as f64 / 1024.0,
            self.above_idle_mb(),
            (self.held_rss_kib.saturating_sub(self.idle_rss_kib) * 1024) as f64
                / self.leases.max(1) as f64,
            self.window_secs,
            100.0 * self.cpu_secs / w,
            self.renewals / w,
            self.redis_scripts / w,
            self.renewals / self.redis_scripts.max(1.0),
            self.redis_commands / w,
            self.held_after as u64,
            self.lost as u64,
        )
    }

    pub fn above_idle_mb(&self) -> f64 {
        self.held_rss_kib.saturating_sub(self.idle_rss_kib) as f64 / 1024.0
    }
}

/// Sum of every sample of `name` (optionally only those whose labels
/// contain `label`) in a Prometheus text exposition.
fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// (round trips, commands) Redis has served: `EVALSHA`/`EVAL` calls and
/// other top-level commands are round trips; `commands` also counts every
/// `redis.call` inside scripts (which `total_commands_processed` includes).
async fn redis_counts(conn: &mut redis::aio::MultiplexedConnection) -> Result<(f64, f64), String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    let calls = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
            .and_then(|v| v.split(',').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    let scripts = calls("evalsha") + calls("eval");
    let stats: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    let total: f64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| "no total_commands_processed in INFO".to_owned())?;
    Ok((scripts, total))
}

async fn metrics(conn: &mut ApiConn) -> Result<String, String> {
    let (_, body) = conn
        .send(hyper::Method::GET, "/metrics", &[], bytes::Bytes::new())
        .await?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Starts a sidecar on `redis_url`, acquires `n` auto-renewed leases with
/// `ttl_ms`, then watches it for `window` seconds.
pub async fn run(
    redis_url: &str,
    n: usize,
    ttl_ms: u64,
    window: u64,
) -> Result<LeaseReport, String> {
    let api_addr = format!("127.0.0.1:{}", local::free_port()?);
    let admin_addr = format!("127.0.0.1:{}", local::free_port()?);
    let sidecar: Proc = local::fencer(
        "sidecar",
        &[
            ("sidecar.listen", api_addr.clone()),
            ("proxy.enabled", "false".into()),
            ("backend.kind", "redis".into()),
            ("backend.redis.url", redis_url.into()),
            ("admin.listen", admin_addr.clone()),
        ],
        &api_addr,
    )
    .await?;
    let pid = sidecar.pid();
    let redis = redis::Client::open(redis_url).map_err(|e| e.to_string())?;
    let mut rconn = redis
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_rss_kib = local::rss_kib(pid).ok_or("cannot read the sidecar's RSS")?;

    let tag = rand::random::<u32>();
    let started = Instant::now();
    let body = format!(r#"{{"ttl_ms":{ttl_ms},"auto_renew":true,"keepalive_ms":3600000}}"#);
    let api = format!("http://{api_addr}");
    // 32 connections, each acquiring its share in sequence.
    let conns = 32;
    let results: Vec<Result<(), String>> = futures_util::stream::iter(0..conns)
        .map(|c| {
            let (api, body) = (api.clone(), body.clone());
            async move {
                let mut conn = ApiConn::new(&api);
                for i in (c..n).step_by(conns) {
                    let (status, reply) = conn
                        .post_json(&format!("/v1/locks/lease:{tag}:{i}/acquire"), body.clone())
                        .await?;
                    if status != 200 {
                        return Err(format!(
                            "acquire {i}: {status} {}",
                            String::from_utf8_lossy(&reply)
                        ));
                    }
                }
                Ok(())
            }
        })
        .buffer_unordered(conns)
        .collect()
        .await;
    results.into_iter().collect::<Result<Vec<()>, String>>()?;
    let acquire_secs = started.elapsed().as_secs_f64();

    let mut metrics_conn = ApiConn::new(&format!("http://{admin_addr}"));
    let scrape = |text: &str| {
        (
            metric_sum(text, "fencer_renewals_total", "result=\"renewed\""),
            metric_sum(text, "fencer_leases_held", ""),
            metric_sum(text, "fencer_lost_leases_total", ""),
        )
    };
    let text0 = metrics(&mut metrics_conn).await?;
    let (renewed0, _, _) = scrape(&text0);
    let (scripts0, cmds0) = redis_counts(&mut rconn).await?;
    let cpu0 = local::cpu_secs(pid).ok_or("cannot read the sidecar's CPU time")?;
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(window)).await;
    let cpu1 = local::cpu_secs(pid).ok_or("cannot read the sidecar's CPU time")?;
    let window_secs = w0.elapsed().as_secs_f64();
    let (scripts1, cmds1) = redis_counts(&mut rconn).await?;
    let text1 = metrics(&mut metrics_conn).await?;
    let (renewed1, held, lost) = scrape(&text1);
    let held_rss_kib = local::rss_kib(pid).ok_or("cannot read the sidecar's RSS")?;
    Ok(LeaseReport {
        leases: n,
        acquire_secs,
        idle_rss_kib,
        held_rss_kib,
        window_secs,
        cpu_secs: cpu1 - cpu0,
        renewals: renewed1 - renewed0,
        redis_scripts: scripts1 - scripts0,
        // The INFO calls themselves are not the sidecar's.
        redis_commands: (cmds1 - cmds0 - 2.0).max(0.0),
        held_after: held,
        lost,
    })
}
