//! `fencer bench`: drives a running sidecar's lock API with N clients over
//! K keys and, in the same run, a direct Redis client doing the same lock
//! protocol (SET NX PX + EVALSHA compare-and-delete, 10 ms polling while the
//! lock is taken), and prints both with their ratio.
//!
//! Inside every critical section each client does a deliberately
//! non-atomic GET/SET increment of a per-key counter in Redis; at the end
//! the counters must equal the cycles counted, or updates were lost.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Base URL of the sidecar's lock API.
    #[arg(long, default_value = "http://127.0.0.1:7411")]
    pub api: String,
    /// The Redis the sidecar uses (for the baseline client and the
    /// lost-update counters).
    #[arg(long, default_value = "redis://127.0.0.1:6379/0")]
    pub redis: String,
    /// Scenarios: uncontended-1, uncontended-16, contended-16, spread-64x8, or all.
    #[arg(long, default_value = "all")]
    pub scenario: String,
    /// Seconds per scenario and side.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Skip the direct-Redis baseline.
    #[arg(long)]
    pub no_baseline: bool,
}

#[derive(Debug, Clone, Copy)]
struct Scenario {
    name: &'static str,
    clients: usize,
    keys: usize,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "uncontended-1",
        clients: 1,
        keys: 1,
    },
    Scenario {
        name: "uncontended-16",
        clients: 16,
        keys: 16,
    },
    Scenario {
        name: "contended-16",
        clients: 16,
        keys: 1,
    },
    Scenario {
        name: "spread-64x8",
        clients: 64,
        keys: 8,
    },
];

/// What one side measured in one scenario.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub cycles: u64,
    pub owner_changes: u64,
    pub errors: u64,
    pub lost_updates: i64,
    pub secs: f64,
    pub wait_us: Vec<u32>,
    pub cycle_us: Vec<u32>,
    pub per_client: Vec<u64>,
}

impl Report {
    fn rate(&self, n: u64) -> f64 {
        n as f64 / self.secs.max(1e-9)
    }
    fn pct(v: &[u32], p: f64) -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v[((v.len() - 1) as f64 * p) as usize] as f64 / 1000.0
    }
    fn fairness(&self) -> f64 {
        let min = self.per_client.iter().min().copied().unwrap_or(0) as f64;
        let max = self.per_client.iter().max().copied().unwrap_or(0) as f64;
        if max == 0.0 {
            0.0
        } else {
            min / max
        }
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn post(
    client: &HttpClient,
    url: &str,
    body: String,
) -> Result<(u16, serde_json::Value), String> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, serde_json::from_slice(&bytes).unwrap_or_default()))
}

/// Which side runs a scenario.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Fencer,
    Baseline,
}

const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

struct Shared {
    stop: AtomicBool,
    last_owner: Vec<AtomicUsize>,
}

#[allow(clippy::too_many_arguments)]
async fn client_loop(
    side: Side,
    id: usize,
    key_index: usize,
    run_tag: String,
    http: HttpClient,
    api: String,
    redis: redis::Client,
    shared: Arc<Shared>,
) -> Result<Report, String> {
    let mut conn = redis
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let release = redis::Script::new(RELEASE);
    let key = format!("bench:{run_tag}:{key_index}");
    let counter = format!("bench-counter:{run_tag}:{key_index}");
    let lock_key = format!("bench-lock:{run_tag}:{key_index}");
    let acquire_url = format!("{api}/v1/locks/{key}/acquire");
    let release_url = format!("{api}/v1/locks/{key}/release");
    let mut r = Report::default();
    let token = format!("c{id}");
    while !shared.stop.load(Ordering::Relaxed) {
        let t0 = Instant::now();
        // Acquire.
        let lease = match side {
            Side::Fencer => match post(
                &http,
                &acquire_url,
                r#"{"ttl_ms":10000,"wait_ms":10000}"#.into(),
            )
            .await
            {
                Ok((200, v)) => v["lease_id"].as_str().unwrap_or_default().to_owned(),
                _ => {
                    r.errors += 1;
                    continue;
                }
            },
            Side::Baseline => loop {
                let ok: Option<String> = redis::cmd("SET")
                    .arg(&lock_key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(10_000)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if ok.is_some() {
                    break token.clone();
                }
                if shared.stop.load(Ordering::Relaxed) {
                    break String::new();
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            },
        };
        if lease.is_empty() {
            break;
        }
        let waited = t0.elapsed();
        // The critical section: a non-atomic increment.
        let v: Option<i64> = redis::cmd("GET")
            .arg(&counter)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let _: () = redis::cmd("SET")
            .arg(&counter)
            .arg(v.unwrap_or(0) + 1)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        if shared.last_owner[key_index].swap(id, Ordering::Relaxed) != id {
            r.owner_changes += 1;
        }
        // Release.
        match side {
            Side::Fencer => {
                if !matches!(
                    post(&http, &release_url, format!(r#"{{"lease_id":"{lease}"}}"#)).await,
                    Ok((200, _))
                ) {
                    r.errors += 1;
                }
            }
            Side::Baseline => {
                let _: i64 = release
                    .key(&lock_key)
                    .arg(&lease)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        r.cycles += 1;
        r.wait_us
            .push(waited.as_micros().min(u32::MAX as u128) as u32);
        r.cycle_us
            .push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
    }
    Ok(r)
}

async fn run_side(
    side: Side,
    sc: Scenario,
    args: &BenchArgs,
    http: &HttpClient,
    redis: &redis::Client,
) -> Result<Report, String> {
    let run_tag = format!(
        "{}-{}-{}",
        sc.name,
        if side == Side::Fencer { "f" } else { "b" },
        rand::random::<u32>()
    );
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        last_owner: (0..sc.keys).map(|_| AtomicUsize::new(usize::MAX)).collect(),
    });
    let api = args.api.trim_end_matches('/').to_owned();
    let mut tasks = Vec::new();
    for id in 0..sc.clients {
        tasks.push(tokio::spawn(client_loop(
            side,
            id,
            id % sc.keys,
            run_tag.clone(),
            http.clone(),
            api.clone(),
            redis.clone(),
            shared.clone(),
        )));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    shared.stop.store(true, Ordering::Relaxed);
    let mut total = Report::default();
    let mut per_key = vec![0u64; sc.keys];
    for (id, t) in tasks.into_iter().enumerate() {
        let r = t.await.map_err(|e| e.to_string())??;
        total.cycles += r.cycles;
        total.owner_changes += r.owner_changes;
        total.errors += r.errors;
        total.wait_us.extend(r.wait_us);
        total.cycle_us.extend(r.cycle_us);
        total.per_client.push(r.cycles);
        per_key[id % sc.keys] += r.cycles;
    }
    total.secs = started.elapsed().as_secs_f64();
    let mut conn = redis
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    for (k, cycles) in per_key.iter().enumerate() {
        let v: Option<i64> = redis::cmd("GET")
            .arg(format!("bench-counter:{run_tag}:{k}"))
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        total.lost_updates += *cycles as i64 - v.unwrap_or(0);
    }
    total.wait_us.sort_unstable();
    total.cycle_us.sort_unstable();
    Ok(total)
}

fn line(label: &str, r: &Report) -> String {
    format!(
        "  {label:<9} cycles/s {:>9.0}  owner changes/s {:>8.0}  wait p50/p99/max ms {:>6.2}/{:>6.2}/{:>7.2}  cycle p50/p99 ms {:>6.2}/{:>6.2}  fairness {:.2}  lost {}  errors {}",
        r.rate(r.cycles),
        r.rate(r.owner_changes),
        Report::pct(&r.wait_us, 0.5),
        Report::pct(&r.wait_us, 0.99),
        Report::pct(&r.wait_us, 1.0),
        Report::pct(&r.cycle_us, 0.5),
        Report::pct(&r.cycle_us, 0.99),
        r.fairness(),
        r.lost_updates,
        r.errors,
    )
}

/// Runs the selected scenarios; returns every report, for tests.
pub async fn measure(args: &BenchArgs) -> Result<Vec<(String, Report, Option<Report>)>, String> {
    let http: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http();
    let redis = redis::Client::open(args.redis.as_str()).map_err(|e| e.to_string())?;
    let selected: Vec<Scenario> = SCENARIOS
        .iter()
        .copied()
        .filter(|s| args.scenario == "all" || args.scenario.split(',').any(|n| n == s.name))
        .collect();
    if selected.is_empty() {
        return Err(format!(
            "unknown scenario `{}`; choose from all, {}",
            args.scenario,
            SCENARIOS
                .iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut out = Vec::new();
    for sc in selected {
        let fencer = run_side(Side::Fencer, sc, args, &http, &redis).await?;
        let baseline = if args.no_baseline {
            None
        } else {
            Some(run_side(Side::Baseline, sc, args, &http, &redis).await?)
        };
        println!(
            "{} ({} clients, {} keys, {} s each)",
            sc.name, sc.clients, sc.keys, args.seconds
        );
        println!("{}", line("fencer", &fencer));
        if let Some(b) = &baseline {
            println!("{}", line("baseline", b));
            println!(
                "  ratio     cycles/s {:.2}x  owner changes/s {:.2}x",
                fencer.rate(fencer.cycles) / b.rate(b.cycles).max(1e-9),
                fencer.rate(fencer.owner_changes) / b.rate(b.owner_changes).max(1e-9)
            );
        }
        out.push((sc.name.to_owned(), fencer, baseline));
    }
    Ok(out)
}

pub async fn run(args: BenchArgs) -> Result<(), String> {
    measure(&args).await.map(|_| ())
}
