//! `[backend.redis]`: where the Redis is (one server, a Sentinel-managed
//! master, or a Cluster), how tokens are minted there, and how many
//! replicas must have a lock write before it counts.

use serde::{Deserialize, Serialize};

use super::counters::CounterPolicy;
use crate::settings::check::{check_range, config_enum, invalid, ConfigError};

/// How Redis mints fencing tokens.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum TokenMode {
    /// `INCR` of a per-key counter: small tokens (1, 2, 3 …), but a Redis that
    /// loses the counter (no persistence, failover to a lagging replica)
    /// reissues old values. Safe only on one server with AOF and
    /// `appendfsync always` that never fails over; refused with a replicated
    /// topology unless `allow_counter_with_failover`.
    Counter,
    /// `max(counter + 1, server_time_ms * 1024)`: tokens move forward even
    /// when the counter is lost, as long as the Redis server clock does not
    /// step back and a key averages under ~1M acquisitions per second.
    HybridClock,
}
config_enum!(TokenMode { Counter => "counter", HybridClock => "hybrid_clock" });

/// Which Redis topology fencer talks to.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum RedisMode {
    /// One server at `url`.
    Single,
    /// The master that `sentinels` name for `master_name`, followed through
    /// failovers.
    Sentinel,
    /// A Redis Cluster reached through any of `nodes`.
    Cluster,
}
config_enum!(RedisMode { Single => "single", Sentinel => "sentinel", Cluster => "cluster" });

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisSettings {
    pub mode: RedisMode,
    /// `redis://[user:password@]host:port/db` or `rediss://` for TLS. In
    /// sentinel mode its scheme, credentials and database are used on the
    /// master the sentinels name (its host and port are not used).
    pub url: String,
    /// Sentinel mode: `host:port` of each sentinel.
    pub sentinels: Vec<String>,
    /// Sentinel mode: the name the sentinels monitor the master under.
    pub master_name: String,
    /// Sentinel mode: credentials and TLS for the sentinels themselves
    /// (they are often configured apart from the data nodes).
    pub sentinel_username: Option<String>,
    pub sentinel_password: Option<String>,
    pub sentinel_tls: bool,
    /// Cluster mode: `redis://[user:password@]host:port` (or `rediss://`)
    /// of some nodes; the rest are discovered.
    pub nodes: Vec<String>,
    /// When above 0: an acquire or renew is granted only after `WAIT`
    /// confirms this many replicas have the write, within `wait_timeout_ms`;
    /// otherwise the lock is released and the call fails. 0 = off.
    pub wait_replicas: u32,
    pub wait_timeout_ms: u64,
    /// How often the master's role (sentinel) or the slot map (cluster) is
    /// checked, besides the push events that normally announce a failover.
    pub topology_check_interval_ms: u64,
    pub key_prefix: String,
    pub request_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub token_mode: TokenMode,
    /// `counter` tokens with a replicated Redis (sentinel or cluster mode,
    /// `wait_replicas` above 0) are refused: a failover to a replica that
    /// missed the last `INCR` hands the same number out again (measured:
    /// two leases with token 6 for ~56 ms). `true` accepts that, e.g. when
    /// every write passes a gateway that refuses a reissued number.
    pub allow_counter_with_failover: bool,
    /// A key's token counter expires this long after its last acquisition
    /// (and never before the clock floor has passed it): see
    /// [`super::counters`]. Unset: a day with `hybrid_clock`, never with
    /// `counter` tokens or `allow_eviction`; 0 = never.
    pub counter_idle_ttl_ms: Option<u64>,
    /// Every master's `maxmemory-policy` must be `noeviction`: under any
    /// other policy Redis may evict a live lock entry (`volatile-*` evicts
    /// keys with a TTL first — exactly the lock entries) and grant the key
    /// again while its holder still reports it held. Until every master in
    /// use says `noeviction` the backend is not ready and acquires answer
    /// 503. `true` turns the refusal into a warning at every check.
    pub allow_eviction: bool,
    /// How often every master's eviction policy is read again, besides at
    /// start, after each (re)connection and after each failover: an
    /// operator can `CONFIG SET maxmemory-policy` on a live server.
    pub eviction_check_interval_ms: u64,
    /// PEM CA certificate(s) for `rediss://` with a private CA (default:
    /// the public web roots).
    pub ca_file: Option<String>,
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            mode: RedisMode::Single,
            url: "redis://127.0.0.1:6379/0".into(),
            sentinels: Vec::new(),
            master_name: String::new(),
            sentinel_username: None,
            sentinel_password: None,
            sentinel_tls: false,
            nodes: Vec::new(),
            wait_replicas: 0,
            wait_timeout_ms: 100,
            topology_check_interval_ms: 1_000,
            key_prefix: "fencer:".into(),
            request_timeout_ms: 1_000,
            connect_timeout_ms: 1_000,
            token_mode: TokenMode::HybridClock,
            allow_counter_with_failover: false,
            counter_idle_ttl_ms: None,
            allow_eviction: false,
            eviction_check_interval_ms: 10_000,
            ca_file: None,
        }
    }
}

/// `redis://` or `rediss://` with a host.
fn check_redis_url(field: &'static str, raw: &str) -> Result<url::Url, ConfigError> {
    let url = url::Url::parse(raw).map_err(|e| {
        invalid(
            field,
            format!("not a URL ({e}); expected redis://host:port/db or rediss://…"),
        )
    })?;
    if !matches!(url.scheme(), "redis" | "rediss") {
        return Err(invalid(
            field,
            format!(
                "scheme `{}` not allowed; allowed: redis, rediss",
                url.scheme()
            ),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(field, "needs a host"));
    }
    Ok(url)
}

/// `host:port` with a port.
fn check_host_port(field: &'static str, raw: &str) -> Result<(), ConfigError> {
    let ok = raw
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("`{raw}`: expected host:port, e.g. redis-sentinel-0.redis:26379"),
        ))
    }
}

impl RedisSettings {
    /// How this section's token counters expire.
    pub fn counters(&self) -> CounterPolicy {
        CounterPolicy {
            field: "backend.redis.counter_idle_ttl_ms",
            configured: self.counter_idle_ttl_ms,
            clock_floor: self.token_mode == TokenMode::HybridClock,
            allow_eviction: self.allow_eviction,
            eviction_field: "backend.redis.allow_eviction",
        }
    }

    /// `selected`: this is the configured backend, so its topology must be
    /// complete (an unused section keeps its defaults and is not checked).
    pub(crate) fn validate(&self, selected: bool) -> Result<(), ConfigError> {
        if selected {
            match self.mode {
                RedisMode::Single | RedisMode::Sentinel => {
                    check_redis_url("backend.redis.url", &self.url)?;
                }
                RedisMode::Cluster => {}
            }
            match self.mode {
                RedisMode::Single => {}
                RedisMode::Sentinel => {
                    if self.sentinels.is_empty() {
                        return Err(invalid(
                            "backend.redis.sentinels",
                            "sentinel mode needs at least one sentinel (host:port); list all of them",
                        ));
                    }
                    for s in &self.sentinels {
                        check_host_port("backend.redis.sentinels", s)?;
                    }
                    if self.master_name.is_empty()
                        || self.master_name.len() > 256
                        || self.master_name.chars().any(char::is_whitespace)
                    {
                        return Err(invalid(
                            "backend.redis.master_name",
                            "sentinel mode needs the monitored master's name (1 to 256 characters, no spaces)",
                        ));
                    }
                }
                RedisMode::Cluster => {
                    if self.nodes.is_empty() {
                        return Err(invalid(
                            "backend.redis.nodes",
                            "cluster mode needs at least one node URL (redis://host:port)",
                        ));
                    }
                    for n in &self.nodes {
                        let url = check_redis_url("backend.redis.nodes", n)?;
                        if url
                            .path()
                            .trim_matches('/')
                            .parse::<u32>()
                            .is_ok_and(|db| db != 0)
                        {
                            return Err(invalid(
                                "backend.redis.nodes",
                                "Redis Cluster has only database 0",
                            ));
                        }
                    }
                }
            }
            self.check_counter_tokens()?;
        }
        check_range(
            "backend.redis.sentinels (count)",
            self.sentinels.len() as u64,
            0,
            64,
        )?;
        check_range(
            "backend.redis.nodes (count)",
            self.nodes.len() as u64,
            0,
            1000,
        )?;
        check_range(
            "backend.redis.wait_replicas",
            self.wait_replicas.into(),
            0,
            64,
        )?;
        check_range(
            "backend.redis.wait_timeout_ms",
            self.wait_timeout_ms,
            1,
            10_000,
        )?;
        check_range(
            "backend.redis.topology_check_interval_ms",
            self.topology_check_interval_ms,
            50,
            60_000,
        )?;
        if self.key_prefix.len() > 64 || self.key_prefix.contains(['{', '}']) {
            return Err(invalid(
                "backend.redis.key_prefix",
                "at most 64 bytes and no `{` or `}` (they would break the Cluster hash tag)",
            ));
        }
        check_range(
            "backend.redis.request_timeout_ms",
            self.request_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.redis.connect_timeout_ms",
            self.connect_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.redis.eviction_check_interval_ms",
            self.eviction_check_interval_ms,
            100,
            600_000,
        )?;
        self.counters().validate()?;
        Ok(())
    }

    /// `counter` tokens only where no failover can reissue them. A
    /// replica is promoted with whatever replication had delivered, so its
    /// counter may be behind tokens already handed out, and its next
    /// `INCR` repeats one (PITFALLS §3); AOF with `appendfsync always` on
    /// the old master does not help, the new master never had the write.
    /// Replication the configuration reveals: sentinel and cluster mode,
    /// and `wait_replicas` (a master with replicas). A single server whose
    /// replicas an operator promotes by hand is not visible here (docs/backends.md).
    fn check_counter_tokens(&self) -> Result<(), ConfigError> {
        if self.token_mode != TokenMode::Counter || self.allow_counter_with_failover {
            return Ok(());
        }
        let replicated = match self.mode {
            RedisMode::Sentinel => "sentinel mode",
            RedisMode::Cluster => "cluster mode",
            RedisMode::Single if self.wait_replicas > 0 => "wait_replicas above 0",
            RedisMode::Single => return Ok(()),
        };
        Err(invalid(
            "backend.redis.token_mode",
            format!(
                "`counter` with {replicated} can hand out the same token twice: a failover promotes a replica that missed the last INCR and it counts from there again (AOF on the old master does not help); use `hybrid_clock`, or set backend.redis.allow_counter_with_failover = true to accept reissued tokens (docs/guarantees.md)"
            ),
        ))
    }
}
