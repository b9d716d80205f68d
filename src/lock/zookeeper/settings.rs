//! `[backend.zookeeper]`: the ensemble, where fencer keeps its nodes, and
//! the session whose life bounds every lease.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::settings::check::{check_range, invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ZooKeeperSettings {
    /// `host:port,host:port,…` of the ensemble's members (every one: the
    /// client moves to another member when its server goes away).
    pub connect: String,
    /// The node under which fencer keeps its lock queues and token offset.
    pub root: String,
    /// The session timeout to ask for. The server may grant less (its
    /// `minSessionTimeout`/`maxSessionTimeout`); the granted one counts.
    /// A lease may last at most [`max_lease`] of it: the lock node is
    /// ephemeral and dies with the session, so a lease must end on the
    /// sidecar's clock before the ensemble can expire the session.
    pub session_timeout_ms: u64,
    /// How long establishing a session may take before the attempt is
    /// retried (start-up and after an expiry).
    pub connect_timeout_ms: u64,
    /// Bound on one request. An unanswered request has an unknown outcome;
    /// acquire retries find their node by its ticket instead of queueing twice.
    pub request_timeout_ms: u64,
    /// How far apart two members' wall clocks may be. A lock node's
    /// lease-expiry record is the leader's wall-clock time of its last
    /// write (`expiry`); a successor compares it with the time of a write
    /// of its own, and when a leader change lies between the two writes
    /// (two clocks) it waits this much longer before deleting the node.
    pub leader_clock_skew_ms: u64,
    /// `user:password` for ZooKeeper's `digest` scheme. With it, fencer's
    /// nodes get the `creator_all` ACL: only the same identity can touch
    /// them. Usually from `FENCER__BACKEND__ZOOKEEPER__AUTH_DIGEST`.
    pub auth_digest: Option<String>,
    /// Connect with TLS (the ensemble's `secureClientPort`).
    pub tls: bool,
    /// PEM CA the servers' certificates must chain to (TLS). Without it,
    /// the system's web PKI roots.
    pub ca_file: Option<String>,
    /// PEM client certificate and key (mutual TLS), both or neither.
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
}

impl Default for ZooKeeperSettings {
    fn default() -> Self {
        Self {
            connect: String::new(),
            root: "/fencer".into(),
            session_timeout_ms: 30_000,
            connect_timeout_ms: 10_000,
            request_timeout_ms: 2_000,
            leader_clock_skew_ms: 1_000,
            auth_digest: None,
            tls: false,
            ca_file: None,
            cert_file: None,
            key_file: None,
        }
    }
}

/// The longest lease a session of `session` keeps safe: 45% of it, minus
/// the lock-delay (which must also pass before the session could expire).
///
/// Why less than half: a request answered by a follower proves the session
/// was touched there at or after its send time, but the leader, which
/// expires sessions, learns of touches only through the follower's pings.
/// If that follower is cut off right after answering, the leader's newest
/// touch can be up to one client heartbeat (a third of the session) older
/// than the request; a further tenth covers clock-rate drift and ticks.
pub fn max_lease(session: Duration, lock_delay: Duration) -> Duration {
    (session * 9 / 20).saturating_sub(lock_delay)
}

impl ZooKeeperSettings {
    /// `selected`: this is the configured backend, so it needs its ensemble.
    pub(crate) fn validate(&self, selected: bool) -> Result<(), ConfigError> {
        let hosts = self.hosts();
        if selected && hosts.is_empty() {
            return Err(invalid(
                "backend.zookeeper.connect",
                "required: host:port,host:port,… of the ensemble",
            ));
        }
        check_range(
            "backend.zookeeper.connect (count)",
            hosts.len() as u64,
            0,
            15,
        )?;
        for h in &hosts {
            let ok = h.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !ok {
                return Err(invalid(
                    "backend.zookeeper.connect",
                    format!("`{h}`: expected host:port (put the path in backend.zookeeper.root, not a chroot)"),
                ));
            }
        }
        let root_ok = self.root.starts_with('/')
            && self.root.len() <= 256
            && !self.root.ends_with('/')
            && self.root[1..].split('/').all(|seg| {
                !seg.is_empty()
                    && seg != "."
                    && seg != ".."
                    && seg
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            })
            && !self.root.starts_with("/zookeeper");
        if !root_ok {
            return Err(invalid(
                "backend.zookeeper.root",
                "an absolute path like /fencer: segments of [A-Za-z0-9._-], no trailing /, not under /zookeeper, at most 256 bytes",
            ));
        }
        check_range(
            "backend.zookeeper.session_timeout_ms",
            self.session_timeout_ms,
            2_000,
            600_000,
        )?;
        check_range(
            "backend.zookeeper.connect_timeout_ms",
            self.connect_timeout_ms,
            100,
            600_000,
        )?;
        check_range(
            "backend.zookeeper.request_timeout_ms",
            self.request_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.zookeeper.leader_clock_skew_ms",
            self.leader_clock_skew_ms,
            0,
            60_000,
        )?;
        if self.request_timeout_ms * 3 > self.session_timeout_ms {
            return Err(invalid(
                "backend.zookeeper.request_timeout_ms",
                "must be at most a third of session_timeout_ms: a request still waiting then outlives the leases it renews",
            ));
        }
        if let Some(d) = &self.auth_digest {
            if !d.contains(':') || d.starts_with(':') || d.len() > 1024 {
                return Err(invalid(
                    "backend.zookeeper.auth_digest",
                    "expected user:password",
                ));
            }
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(invalid(
                "backend.zookeeper.cert_file",
                "cert_file and key_file go together",
            ));
        }
        if !self.tls && (self.ca_file.is_some() || self.cert_file.is_some()) {
            return Err(invalid(
                "backend.zookeeper.tls",
                "ca_file, cert_file and key_file need tls = true",
            ));
        }
        Ok(())
    }

    /// The members of `connect`, trimmed.
    pub fn hosts(&self) -> Vec<&str> {
        self.connect
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .collect()
    }

    pub fn session_timeout(&self) -> Duration {
        Duration::from_millis(self.session_timeout_ms)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    pub fn leader_clock_skew(&self) -> Duration {
        Duration::from_millis(self.leader_clock_skew_ms)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_ends_well_inside_the_session() {
        let s = Duration::from_secs(30);
        assert_eq!(max_lease(s, Duration::ZERO), Duration::from_millis(13_500));
        assert_eq!(
            max_lease(s, Duration::from_secs(2)),
            Duration::from_millis(11_500)
        );
        assert_eq!(
            max_lease(Duration::from_secs(2), Duration::from_secs(5)),
            Duration::ZERO
        );
    }

    #[test]
    fn connect_strings_and_roots_are_checked() {
        let ok = ZooKeeperSettings {
            connect: "10.0.0.1:2181, zk-1.zk:2181".into(),
            ..Default::default()
        };
        ok.validate(true).unwrap();
        for bad in ["", "zk", "zk:0", "zk:2181/chroot", ":2181"] {
            let s = ZooKeeperSettings {
                connect: bad.into(),
                ..Default::default()
            };
            assert!(s.validate(true).is_err(), "{bad:?} accepted");
        }
        for root in [
            "fencer",
            "/",
            "/fencer/",
            "/a//b",
            "/zookeeper/x",
            "/a/../b",
            "/a b",
        ] {
            let s = ZooKeeperSettings {
                root: root.into(),
                ..ok.clone()
            };
            assert!(s.validate(true).is_err(), "root {root:?} accepted");
        }
        let s = ZooKeeperSettings {
            request_timeout_ms: 20_000,
            ..ok.clone()
        };
        assert!(s.validate(true).is_err());
        let s = ZooKeeperSettings {
            auth_digest: Some("nopassword".into()),
            ..ok.clone()
        };
        assert!(s.validate(true).is_err());
        let s = ZooKeeperSettings {
            ca_file: Some("/ca.pem".into()),
            ..ok
        };
        assert!(s.validate(true).is_err());
    }
}
