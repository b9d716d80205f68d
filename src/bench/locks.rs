//! The lock scenarios: N clients over K keys run acquire → critical
//! section → release, through the sidecar's HTTP API or, as the baseline,
//! with a direct Redis client doing the same lock protocol (SET NX PX,
//! 10 ms polling while the lock is taken, EVALSHA compare-and-delete).
//!
//! Inside every critical section each client does a deliberately
//! non-atomic GET/SET increment of a per-key counter in Redis; at the end
//! the counters must equal the cycles counted, or updates were lost.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::api_conn::ApiConn;
use super::stats::Report;

#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub name: &'static str,
    pub clients: usize,
    pub keys: usize,
}

pub const SCENARIOS: &[Scenario] = &[
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

/// Which side runs a scenario.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Side {
    Fencer,
    Baseline,
}

const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

struct Shared {
    stop: AtomicBool,
    last_owner: Vec<AtomicUsize>,
}

/// The lease id in an acquire response.
#[derive(serde::Deserialize)]
struct AcquireReply {
    lease_id: String,
}

struct Client {
    side: Side,
    id: usize,
    key_index: usize,
    run_tag: String,
    api: String,
    redis: redis::Client,
    shared: Arc<Shared>,
}

fn redis_err(e: redis::RedisError) -> String {
    e.to_string()
}

impl Client {
    async fn run(self) -> Result<Report, String> {
        // Each client has its own connection, as separate application
        // threads or processes would.
        let mut conn = self
            .redis
            .get_multiplexed_async_connection()
            .await
            .map_err(redis_err)?;
        let release = redis::Script::new(RELEASE);
        let (tag, k) = (&self.run_tag, self.key_index);
        let key = format!("bench:{tag}:{k}");
        let counter = format!("bench-counter:{tag}:{k}");
        let lock_key = format!("bench-lock:{tag}:{k}");
        let acquire_path = format!("/v1/locks/{key}/acquire");
        let release_path = format!("/v1/locks/{key}/release");
        let mut api = ApiConn::new(&self.api);
        let mut r = Report::default();
        let token = format!("c{}", self.id);
        while !self.shared.stop.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            let lease = match self.side {
                Side::Fencer => {
                    match api
                        .post_json(&acquire_path, r#"{"ttl_ms":10000,"wait_ms":10000}"#.into())
                        .await
                    {
                        Ok((200, body)) => {
                            serde_json::from_slice::<AcquireReply>(&body)
                                .map_err(|e| format!("bad acquire reply: {e}"))?
                                .lease_id
                        }
                        Ok(_) => {
                            // A timed-out wait at the very end of the run.
                            r.errors += 1;
                            continue;
                        }
                        // No sidecar there: stop, instead of spinning.
                        Err(e) => return Err(format!("lock API {}: {e}", self.api)),
                    }
                }
                Side::Baseline => loop {
                    let ok: Option<String> = redis::cmd("SET")
                        .arg(&lock_key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(10_000)
                        .query_async(&mut conn)
                        .await
                        .map_err(redis_err)?;
                    if ok.is_some() {
                        break token.clone();
                    }
                    if self.shared.stop.load(Ordering::Relaxed) {
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
                .map_err(redis_err)?;
            let _: () = redis::cmd("SET")
                .arg(&counter)
                .arg(v.unwrap_or(0) + 1)
                .query_async(&mut conn)
                .await
                .map_err(redis_err)?;
            if self.shared.last_owner[k].swap(self.id, Ordering::Relaxed) != self.id {
                r.owner_changes += 1;
            }
            match self.side {
                Side::Fencer => {
                    let body = format!(r#"{{"lease_id":"{lease}"}}"#);
                    if !matches!(api.post_json(&release_path, body).await, Ok((200, _))) {
                        r.errors += 1;
                    }
                }
                Side::Baseline => {
                    let _: i64 = release
                        .key(&lock_key)
                        .arg(&lease)
                        .invoke_async(&mut conn)
                        .await
                        .map_err(redis_err)?;
                }
            }
            r.record(waited, t0.elapsed());
        }
        Ok(r)
    }
}

/// Runs one side of `sc` for `secs` against the sidecar at `api` and the
/// Redis at `redis`.
pub async fn run_side(
    side: Side,
    sc: Scenario,
    secs: u64,
    api: &str,
    redis: &redis::Client,
) -> Result<Report, String> {
    // redis-rs leaves Nagle on (TcpSettings::default(): nodelay false) while
    // the HTTP client sets TCP_NODELAY: give the Redis connections of both
    // sides the same socket options, so the baseline is the same kind of
    // client as the one talking to the sidecar.
    let redis = &nodelay(redis)?;
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
    let tasks: Vec<_> = (0..sc.clients)
        .map(|id| {
            tokio::spawn(
                Client {
                    side,
                    id,
                    key_index: id % sc.keys,
                    run_tag: run_tag.clone(),
                    api: api.to_owned(),
                    redis: redis.clone(),
                    shared: shared.clone(),
                }
                .run(),
            )
        })
        .collect();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    shared.stop.store(true, Ordering::Relaxed);
    let mut total = Report::default();
    let mut per_key = vec![0u64; sc.keys];
    for (id, t) in tasks.into_iter().enumerate() {
        let r = t.await.map_err(|e| e.to_string())??;
        per_key[id % sc.keys] += r.cycles;
        total.absorb(r);
    }
    total.secs = started.elapsed().as_secs_f64();
    let mut conn = redis
        .get_multiplexed_async_connection()
        .await
        .map_err(redis_err)?;
    for (k, cycles) in per_key.iter().enumerate() {
        let v: Option<i64> = redis::cmd("GET")
            .arg(format!("bench-counter:{run_tag}:{k}"))
            .query_async(&mut conn)
            .await
            .map_err(redis_err)?;
        total.lost_updates += *cycles as i64 - v.unwrap_or(0);
    }
    total.sort();
    Ok(total)
}

/// `redis` with TCP_NODELAY on its connections (its other TCP settings
/// kept).
fn nodelay(redis: &redis::Client) -> Result<redis::Client, String> {
    let info = redis.get_connection_info().clone();
    let tcp = info.tcp_settings().clone().set_nodelay(true);
    redis::Client::open(info.set_tcp_settings(tcp)).map_err(redis_err)
}
