//! The ZooKeeper backend's series: the session (whose expiry loses every
//! lease at once), queue nodes, and the leases the backend ended itself.

use prometheus::{Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use super::register;

pub struct ZooKeeperMetrics {
    /// Session state changes: connected, disconnected, reconnected,
    /// expired, auth_failed, connect_failed.
    pub session_events: IntCounterVec,
    /// 1 while a session is established and connected.
    pub session_up: IntGauge,
    /// The session timeout the ensemble granted (it may differ from the one
    /// asked for; it bounds the longest lease).
    pub session_timeout: Gauge,
    /// This sidecar's nodes standing in lock queues (waiting, not holding).
    pub queue_nodes: IntGauge,
    /// Held nodes the backend deleted because their lease's TTL passed
    /// without a renewal.
    pub lease_expiries: IntCounter,
    /// Node deletions that failed and were retried later (the key stays
    /// blocked until one succeeds or the session ends).
    pub cleanup_retries: IntCounter,
    /// Other sessions' nodes this sidecar deleted because their
    /// lease-expiry record passed on the ensemble's clock (their sidecar
    /// died, froze or was cut off).
    pub dead_nodes_deleted: IntCounter,
    /// Keepalives of this sidecar's waiting nodes, by result: ok,
    /// node_gone (deleted as dead: the waiter queues again), error.
    pub keepalives: IntCounterVec,
}

impl ZooKeeperMetrics {
    pub fn new(registry: &Registry) -> ZooKeeperMetrics {
        let m = ZooKeeperMetrics {
            session_events: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_zookeeper_session_events_total",
                        "ZooKeeper session state changes: connected (new session), disconnected, reconnected (same session), expired (every lease of the session lost), auth_failed, connect_failed.",
                    ),
                    &["event"],
                )
                .expect("valid metric"),
            ),
            session_up: register(
                registry,
                IntGauge::new(
                    "fencer_zookeeper_session_up",
                    "1 while the ZooKeeper session is established and connected.",
                )
                .expect("valid metric"),
            ),
            session_timeout: register(
                registry,
                Gauge::new(
                    "fencer_zookeeper_session_timeout_seconds",
                    "The session timeout the ZooKeeper ensemble granted; leases may last at most 45% of it minus the lock-delay.",
                )
                .expect("valid metric"),
            ),
            queue_nodes: register(
                registry,
                IntGauge::new(
                    "fencer_zookeeper_queue_nodes",
                    "This sidecar's nodes waiting in ZooKeeper lock queues.",
                )
                .expect("valid metric"),
            ),
            lease_expiries: register(
                registry,
                IntCounter::new(
                    "fencer_zookeeper_lease_expiries_total",
                    "Lock nodes deleted by the backend because the lease's TTL passed without a renewal.",
                )
                .expect("valid metric"),
            ),
            cleanup_retries: register(
                registry,
                IntCounter::new(
                    "fencer_zookeeper_cleanup_retries_total",
                    "ZooKeeper node deletions that failed and were retried.",
                )
                .expect("valid metric"),
            ),
            dead_nodes_deleted: register(
                registry,
                IntCounter::new(
                    "fencer_zookeeper_dead_nodes_deleted_total",
                    "Lock nodes of other sessions deleted because their lease-expiry record (last write's mtime + life) passed on the ensemble's clock: their sidecar died, froze or was cut off.",
                )
                .expect("valid metric"),
            ),
            keepalives: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_zookeeper_keepalives_total",
                        "Keepalives of this sidecar's waiting ZooKeeper nodes (refreshing their lease-expiry record), by result: ok, node_gone (deleted as dead; the waiter queues again), error.",
                    ),
                    &["result"],
                )
                .expect("valid metric"),
            ),
        };
        for r in ["ok", "node_gone", "error"] {
            m.keepalives.with_label_values(&[r]);
        }
        for e in [
            "connected",
            "disconnected",
            "reconnected",
            "expired",
            "auth_failed",
            "connect_failed",
        ] {
            m.session_events.with_label_values(&[e]);
        }
        m
    }
}
