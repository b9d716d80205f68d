//! `fencer bench`: drives a running sidecar's lock API and reports rates and
//! latencies. (The baseline comparisons of the benchmark milestone build on
//! this.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Base URL of the sidecar's lock API.
    #[arg(long, default_value = "http://127.0.0.1:7411")]
    pub api: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub clients: u32,
    /// Distinct keys (client i uses key i % keys).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub keys: u32,
    /// Seconds to run.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Key prefix (so runs do not collide).
    #[arg(long, default_value = "bench")]
    pub prefix: String,
}

#[derive(Debug, Default)]
struct ClientStats {
    cycles: u64,
    busy: u64,
    errors: u64,
    cycle_us: Vec<u32>,
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

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
    let json = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    Ok((status, json))
}

pub async fn run(args: BenchArgs) -> Result<(), String> {
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(args.clients as usize)
        .build_http();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..args.clients {
        let client = client.clone();
        let stop = stop.clone();
        let key = format!("{}:{}", args.prefix, i % args.keys);
        let base = args.api.trim_end_matches('/').to_owned();
        tasks.push(tokio::spawn(async move {
            let acquire = format!("{base}/v1/locks/{key}/acquire");
            let release = format!("{base}/v1/locks/{key}/release");
            let mut st = ClientStats::default();
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                match post(
                    &client,
                    &acquire,
                    r#"{"ttl_ms":10000,"wait_ms":10000}"#.into(),
                )
                .await
                {
                    Ok((200, body)) => {
                        let lease = body["lease_id"].as_str().unwrap_or_default().to_owned();
                        match post(&client, &release, format!(r#"{{"lease_id":"{lease}"}}"#)).await
                        {
                            Ok((200, _)) => {
                                st.cycles += 1;
                                st.cycle_us
                                    .push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                            }
                            _ => st.errors += 1,
                        }
                    }
                    Ok((409, _)) => st.busy += 1,
                    _ => {
                        st.errors += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            st
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let (mut cycles, mut busy, mut errors) = (0, 0, 0);
    let mut per_client = Vec::new();
    for t in tasks {
        let st = t.await.map_err(|e| e.to_string())?;
        cycles += st.cycles;
        busy += st.busy;
        errors += st.errors;
        per_client.push(st.cycles);
        all.extend(st.cycle_us);
    }
    let secs = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.is_empty() {
            return 0.0;
        }
        all[((all.len() - 1) as f64 * p) as usize] as f64 / 1000.0
    };
    let min = per_client.iter().min().copied().unwrap_or(0);
    let max = per_client.iter().max().copied().unwrap_or(0);
    println!(
        "clients={} keys={} seconds={:.1}\ncycles/s={:.0} cycles={} busy={} errors={}\ncycle latency ms: p50={:.3} p99={:.3} max={:.3}\nfairness min/max={}/{}",
        args.clients,
        args.keys,
        secs,
        cycles as f64 / secs,
        cycles,
        busy,
        errors,
        pct(0.5),
        pct(0.99),
        pct(1.0),
        min,
        max
    );
    Ok(())
}
