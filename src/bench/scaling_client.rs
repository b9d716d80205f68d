//! The clients of the `scaling` scenario ([`super::scaling`]) and the
//! lost-update check over their keys.
//!
//! Client `i` of `N` walks the keys `i, i+N, i+2N, …` below `K` and starts
//! over: with `K ≥ N` the clients' keys are disjoint (no contention, only
//! the cost of the number of keys), with `K < N` client `i` stays on key
//! `i mod K` and shares it. Each cycle is acquire → a deliberately
//! non-atomic GET/SET increment of the key's counter in Redis → release,
//! like the lock scenarios ([`super::locks`]). Since a client's walk is
//! deterministic, its cycle count says how often it incremented each key,
//! so every touched key's counter is checked (pipelined MGETs), not just a
//! sum that one lost and one doubled update would balance.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::api_conn::ApiConn;
use super::stats::Report;

/// Counters read per MGET in the lost-update check.
const CHECK_BATCH: usize = 1000;

/// The keys one client walks: `first + j * stride` for `j` in `0..len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk {
    first: u64,
    stride: u64,
    len: u64,
}

impl Walk {
    /// Client `i` of `clients` over `keys` keys (both at least 1).
    pub fn new(i: usize, clients: usize, keys: u64) -> Walk {
        let (i, n) = (i as u64, clients as u64);
        if i < keys {
            Walk {
                first: i,
                stride: n,
                len: (keys - i).div_ceil(n),
            }
        } else {
            Walk {
                first: i % keys,
                stride: n,
                len: 1,
            }
        }
    }

    /// The key of the client's `step`-th cycle.
    pub fn key(&self, step: u64) -> u64 {
        self.first + (step % self.len) * self.stride
    }

    /// Adds to `expected` how often each key was incremented by `cycles`
    /// cycles of this walk.
    pub fn count_into(&self, cycles: u64, expected: &mut HashMap<u64, i64>) {
        let (full, rest) = (cycles / self.len, cycles % self.len);
        for j in 0..self.len.min(cycles) {
            *expected.entry(self.key(j)).or_default() += (full + u64::from(j < rest)) as i64;
        }
    }
}

/// Set by the measuring task: `measuring` while cycles count towards the
/// rates, `stop` when clients should finish their cycle and return.
#[derive(Default)]
pub struct Flags {
    pub measuring: AtomicBool,
    pub stop: AtomicBool,
}

/// What one client did: the cycles completed inside the measured window
/// (with their latencies) and its errors, and all its cycles (for the
/// check).
pub struct ClientResult {
    pub window: Report,
    pub walk: Walk,
    pub all_cycles: u64,
}

#[derive(serde::Deserialize)]
struct AcquireReply {
    lease_id: String,
}

fn redis_err(e: redis::RedisError) -> String {
    e.to_string()
}

/// The lock key (in the sidecar) and counter key (in Redis) of key `k`.
pub fn lock_key(tag: &str, k: u64) -> String {
    format!("scaling:{tag}:{k}")
}

fn counter_key(tag: &str, k: u64) -> String {
    format!("scaling-counter:{tag}:{k}")
}

/// One client until `flags.stop`: its own keep-alive HTTP connection to
/// the sidecar and its own Redis connection, as a separate application
/// thread would have.
pub async fn run_client(
    walk: Walk,
    tag: Arc<str>,
    api: String,
    counters: redis::Client,
    flags: Arc<Flags>,
) -> Result<ClientResult, String> {
    let mut conn = counters
        .get_multiplexed_async_connection()
        .await
        .map_err(redis_err)?;
    let mut api_conn = ApiConn::new(&api);
    let mut window = Report::default();
    let mut step = 0u64;
    while !flags.stop.load(Ordering::Relaxed) {
        let k = walk.key(step);
        let key = lock_key(&tag, k);
        let t0 = Instant::now();
        let lease = match api_conn
            .post_json(
                &format!("/v1/locks/{key}/acquire"),
                r#"{"ttl_ms":10000,"wait_ms":10000}"#.into(),
            )
            .await
        {
            Ok((200, body)) => {
                serde_json::from_slice::<AcquireReply>(&body)
                    .map_err(|e| format!("bad acquire reply: {e}"))?
                    .lease_id
            }
            Ok(_) => {
                // Only with K < N: a wait that timed out. The walk stays on
                // the key, so the check's arithmetic holds.
                window.errors += 1;
                continue;
            }
            Err(e) => return Err(format!("lock API {api}: {e}")),
        };
        let waited = t0.elapsed();
        let counter = counter_key(&tag, k);
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
        let body = format!(r#"{{"lease_id":"{lease}"}}"#);
        let released = matches!(
            api_conn
                .post_json(&format!("/v1/locks/{key}/release"), body)
                .await,
            Ok((200, _))
        );
        step += 1;
        // Errors count over the whole run, cycles only inside the window.
        if !released {
            window.errors += 1;
        }
        if flags.measuring.load(Ordering::Relaxed) {
            window.record(waited, t0.elapsed());
        }
    }
    Ok(ClientResult {
        window,
        walk,
        all_cycles: step,
    })
}

/// Compares every touched key's counter with the increments the clients'
/// cycles imply: (lost updates, keys touched). Positive: updates lost;
/// negative: more increments than cycles (also a broken critical section).
pub async fn check(
    counters: &redis::Client,
    tag: &str,
    results: &[ClientResult],
) -> Result<(i64, u64), String> {
    let mut expected: HashMap<u64, i64> = HashMap::new();
    for r in results {
        r.walk.count_into(r.all_cycles, &mut expected);
    }
    let mut keys: Vec<(u64, i64)> = expected.into_iter().collect();
    keys.sort_unstable();
    let mut conn = counters
        .get_multiplexed_async_connection()
        .await
        .map_err(redis_err)?;
    let mut lost = 0i64;
    for batch in keys.chunks(CHECK_BATCH) {
        let names: Vec<String> = batch.iter().map(|(k, _)| counter_key(tag, *k)).collect();
        let values: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(&names)
            .query_async(&mut conn)
            .await
            .map_err(redis_err)?;
        for ((_, want), got) in batch.iter().zip(values) {
            lost += want - got.unwrap_or(0);
        }
    }
    Ok((lost, keys.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_partition_the_keys_when_there_are_enough() {
        let (clients, keys) = (4, 10u64);
        let mut seen = Vec::new();
        for i in 0..clients {
            let w = Walk::new(i, clients, keys);
            seen.extend((0..w.len).map(|j| w.key(j)));
            // It starts over after its last key.
            assert_eq!(w.key(w.len), w.key(0));
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..keys).collect::<Vec<_>>());
    }

    #[test]
    fn clients_share_keys_when_there_are_fewer_keys() {
        let w = Walk::new(5, 8, 3);
        assert_eq!((w.key(0), w.key(7)), (2, 2));
    }

    #[test]
    fn expected_counts_follow_the_walk() {
        let w = Walk::new(1, 4, 10); // keys 1, 5, 9
        let mut e = HashMap::new();
        w.count_into(7, &mut e); // 1,5,9,1,5,9,1
        assert_eq!((e[&1], e[&5], e[&9]), (3, 2, 2));
        let mut few = HashMap::new();
        w.count_into(2, &mut few);
        assert_eq!(few.len(), 2);
        assert!(!few.contains_key(&9));
    }
}
