//! The Redis backend's topology series: which master it writes to, the
//! failovers it followed, the writes replicas did not confirm in time, and
//! whether its masters may evict lock entries.

use std::sync::Arc;

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::register;

pub struct RedisMetrics {
    /// 1 for each master fencer writes to now (one in sentinel mode, one
    /// per shard in cluster mode), 0 for one it stopped using. Labelled by
    /// `host:port`: a handful of values per deployment.
    pub master: IntGaugeVec,
    pub failovers: IntCounter,
    /// Acquires and renewals refused because `WAIT` counted too few
    /// replicas, by operation.
    pub wait_shortfalls: IntCounterVec,
    /// The smallest `min-replicas-to-write` among the masters (-1: could not
    /// be read). 0 means a demoted master keeps accepting lock writes.
    pub min_replicas_to_write: IntGauge,
    /// Re-resolutions of the master or slot map, by cause.
    pub topology_refreshes: IntCounterVec,
    /// Cluster mode: sharded subscriptions of watched keys made again
    /// after Redis dropped them, by cause (`slot_moved`: a `sunsubscribe`
    /// from a node that lost the slot; `connection_lost`: a node's link
    /// dropped) and result (`ok`, `error`: tried again later).
    pub resubscriptions: IntCounterVec,
    /// The masters' eviction policies (`mode` label).
    pub eviction: Arc<EvictionMetrics>,
    /// Script calls the group commit sent, by `op` (`acquire`, `release`;
    /// single and sentinel modes): one per batch, alone or not.
    pub batches: IntCounterVec,
    /// Lock calls those batches carried, by `op`: divided by
    /// [`RedisMetrics::batches`], the mean batch size.
    pub batched_calls: IntCounterVec,
}

/// The `maxmemory-policy` names Redis knows; any other reads as `other`,
/// so the `policy` label stays a fixed set.
pub const POLICIES: [&str; 8] = [
    "noeviction",
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
];

/// Whether the masters of a Redis-based backend may evict lock entries
/// (`fencer_redis_*` or `fencer_redlock_*`).
pub struct EvictionMetrics {
    /// 1 when every master under the label said `noeviction` at its last
    /// check; 0 when one may evict, refused to say, or is not checked yet.
    /// Labelled by `mode` (Redis: one series) or `master` (RedLock: the
    /// index in `urls`).
    pub safe: IntGaugeVec,
    /// Masters in use per `maxmemory-policy` (plus `unknown`: not read yet
    /// or not readable, `other`: a name outside [`POLICIES`]).
    pub policies: IntGaugeVec,
    /// 1 when `allow_eviction` turned the refusal into a warning.
    pub allowed: IntGauge,
}

impl EvictionMetrics {
    /// `prefix`: `fencer_redis` or `fencer_redlock`; `label`: `mode` or
    /// `master`, with its values known up front.
    pub fn new(
        registry: &Registry,
        prefix: &str,
        label: &str,
        values: &[String],
    ) -> EvictionMetrics {
        let m = EvictionMetrics {
            safe: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        format!("{prefix}_eviction_safe"),
                        "1 when every Redis master says maxmemory-policy noeviction; 0 when one may evict live lock entries, cannot be read or is not checked yet (acquires are then refused unless allow_eviction).",
                    ),
                    &[label],
                )
                .expect("valid metric"),
            ),
            policies: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        format!("{prefix}_maxmemory_policy"),
                        "Redis masters in use per maxmemory-policy (unknown: not read yet or not readable; other: a name fencer does not know).",
                    ),
                    &["policy"],
                )
                .expect("valid metric"),
            ),
            allowed: register(
                registry,
                IntGauge::new(
                    format!("{prefix}_eviction_allowed"),
                    "1 when allow_eviction is set: a master that may evict lock entries is only warned about.",
                )
                .expect("valid metric"),
            ),
        };
        for v in values {
            m.safe.with_label_values(&[v]).set(0);
        }
        for p in POLICIES.iter().chain(&["unknown", "other"]) {
            m.policies.with_label_values(&[p]).set(0);
        }
        m
    }
}

impl RedisMetrics {
    /// `mode`: `backend.redis.mode`, the label of the eviction series.
    pub fn new(registry: &Registry, mode: &str) -> RedisMetrics {
        let m = RedisMetrics {
            eviction: Arc::new(EvictionMetrics::new(
                registry,
                "fencer_redis",
                "mode",
                &[mode.to_owned()],
            )),
            master: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "fencer_redis_master",
                        "1 for each Redis master the sidecar writes lock operations to now, 0 for a former one.",
                    ),
                    &["address"],
                )
                .expect("valid metric"),
            ),
            failovers: register(
                registry,
                IntCounter::new(
                    "fencer_redis_failovers_total",
                    "Master changes the sidecar followed (Sentinel promotion, Cluster shard failover).",
                )
                .expect("valid metric"),
            ),
            wait_shortfalls: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_redis_wait_shortfalls_total",
                        "Acquires and renewals refused because WAIT counted fewer replicas than backend.redis.wait_replicas.",
                    ),
                    &["op"],
                )
                .expect("valid metric"),
            ),
            min_replicas_to_write: register(
                registry,
                IntGauge::new(
                    "fencer_redis_min_replicas_to_write",
                    "The smallest min-replicas-to-write among the masters (-1: unknown). 0: a demoted master keeps accepting lock writes after a failover.",
                )
                .expect("valid metric"),
            ),
            topology_refreshes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_redis_topology_refreshes_total",
                        "Re-resolutions of the Redis master or slot map, by cause (event, error, check).",
                    ),
                    &["cause"],
                )
                .expect("valid metric"),
            ),
            resubscriptions: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_redis_resubscriptions_total",
                        "Cluster mode: release channels of waited-for keys subscribed again after Redis dropped them, by cause (slot_moved, connection_lost) and result (ok, error: retried).",
                    ),
                    &["cause", "result"],
                )
                .expect("valid metric"),
            ),
            batches: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_redis_batches_total",
                        "Script calls the Redis backend's group commit sent, by op (acquire, release); a call alone counts as a batch of one.",
                    ),
                    &["op"],
                )
                .expect("valid metric"),
            ),
            batched_calls: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_redis_batched_calls_total",
                        "Lock calls carried by the Redis backend's group-commit batches, by op; divided by fencer_redis_batches_total, the mean batch size.",
                    ),
                    &["op"],
                )
                .expect("valid metric"),
            ),
        };
        for op in ["acquire", "release"] {
            m.batches.with_label_values(&[op]);
            m.batched_calls.with_label_values(&[op]);
        }
        m.min_replicas_to_write.set(-1);
        for cause in ["slot_moved", "connection_lost"] {
            for result in ["ok", "error"] {
                m.resubscriptions.with_label_values(&[cause, result]);
            }
        }
        for op in ["acquire", "renew"] {
            m.wait_shortfalls.with_label_values(&[op]);
        }
        for cause in ["event", "error", "check"] {
            m.topology_refreshes.with_label_values(&[cause]);
        }
        m
    }
}
