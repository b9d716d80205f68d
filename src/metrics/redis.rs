//! The Redis backend's topology series: which master it writes to, the
//! failovers it followed, and the writes replicas did not confirm in time.

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
}

impl RedisMetrics {
    pub fn new(registry: &Registry) -> RedisMetrics {
        let m = RedisMetrics {
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
        };
        m.min_replicas_to_write.set(-1);
        for op in ["acquire", "renew"] {
            m.wait_shortfalls.with_label_values(&[op]);
        }
        for cause in ["event", "error", "check"] {
            m.topology_refreshes.with_label_values(&[cause]);
        }
        m
    }
}
