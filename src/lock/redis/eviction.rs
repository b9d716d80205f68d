//! Refusing to lock on a Redis that may evict lock entries (PITFALLS §14).
//!
//! A lock entry is a key with a TTL, and fencer's keys with a TTL are its
//! lock entries, lock-delay markers and token counters (which expire after
//! an idle period, [`super::counters`]), so under `maxmemory-policy
//! volatile-*` they are the first keys Redis evicts when memory runs short
//! (`allkeys-*` evicts them too). An evicted entry is a lock Redis grants
//! again while its holder still reports it held: two holders, with nothing
//! failing. An evicted counter that the clock floor has not passed yet (a
//! repaired one, up to ~12 days ahead) lets the next token fall below one
//! already handed out. So every
//! master a backend writes lock entries to must say `noeviction` — with
//! any `maxmemory`: a full `noeviction` server refuses writes with `OOM`,
//! an error the caller sees, instead of silently dropping a lease.
//!
//! The policy is read with `INFO memory` (managed Redis often disables
//! `CONFIG`), falling back to `CONFIG GET`:
//! - at start, and whenever the set of masters changes (Sentinel adopts a
//!   new master, the Cluster slot map names other masters);
//! - after a connection error on a master (a reconnect may reach a server
//!   restarted with another configuration; single, Sentinel and RedLock —
//!   a Cluster error does not say which master broke, so there the slot
//!   map and the periodic check cover it);
//! - every `eviction_check_interval_ms`, because `CONFIG SET
//!   maxmemory-policy` changes a live server without any reconnect.
//!
//! Until a master said `noeviction` the backend is not ready: `ping` (and
//! so `/readyz`) fails and acquires answer 503 `backend_unavailable`
//! naming the server and its policy. Renewals and releases go on: a lease
//! whose entry was evicted is found gone at its next renewal and reported
//! lost; a counter is only written by an acquire or a repair, both
//! admitted here first. With `allow_eviction` the refusal becomes a
//! warning at every check, and counters get no expiry (configuration
//! validation refuses `counter_idle_ttl_ms` with it): `volatile-*` then
//! evicts lock entries, never counters. RedLock tolerates masters it
//! cannot reach, so there a master not checked yet only loses its vote (it
//! could have been restarted with another policy while away), and one that
//! answered with a bad policy stops the backend.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::conn::Target;
use crate::lock::BackendError;
use crate::metrics::redis::{EvictionMetrics, POLICIES};

/// The only policy under which Redis never drops a key on its own.
pub const SAFE_POLICY: &str = "noeviction";

/// An unchecked master is read inline by an acquire at most this often, so
/// an unreachable RedLock master does not add a timeout to every acquire.
const INLINE_RETRY: Duration = Duration::from_millis(250);

/// Unchecked masters are retried in the background this often.
const RETRY_UNCHECKED: Duration = Duration::from_secs(1);

/// What one master said about eviction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    /// Bytes; 0 = no limit (one `CONFIG SET maxmemory` away from evicting).
    pub maxmemory: u64,
}

#[derive(Debug, Clone)]
enum State {
    /// Not read since the master was adopted or (re)connected; the error
    /// of the last try, and when it was.
    Unchecked {
        error: Option<String>,
        tried: Option<Instant>,
    },
    Read(Policy),
    /// The server answered both `INFO memory` and `CONFIG GET` with an
    /// error (renamed or denied commands).
    Unreadable(String),
}

impl State {
    fn fresh() -> State {
        State::Unchecked {
            error: None,
            tried: None,
        }
    }

    fn safe(&self) -> bool {
        matches!(self, State::Read(p) if p.name == SAFE_POLICY)
    }

    fn policy_label(&self) -> &str {
        match self {
            State::Read(p) if POLICIES.contains(&p.name.as_str()) => &p.name,
            State::Read(_) => "other",
            _ => "unknown",
        }
    }
}

/// One master a backend writes lock entries to.
struct Server {
    /// `host:port`, for messages and logs (never a metric label).
    name: String,
    /// The metric label value: the mode (Redis) or the index (RedLock).
    label: String,
    target: Target,
    state: State,
}

/// What a backend is, for messages.
pub struct Wording {
    /// "redis" or "redlock master".
    pub what: &'static str,
    /// The opt-out setting's name.
    pub setting: &'static str,
}

pub struct EvictionGuard {
    wording: Wording,
    allow: bool,
    /// `None` (Redis modes): a master not checked yet refuses acquires.
    /// RedLock's majority: such a master only loses its vote, and it is
    /// read inline by an acquire only while fewer than a majority are safe.
    quorum: Option<usize>,
    timeout: Duration,
    servers: Mutex<Vec<Server>>,
    /// One read at a time: a burst of acquires after a reconnect waits for
    /// the same read instead of each sending its own.
    reading: tokio::sync::Mutex<()>,
    /// Wakes the periodic task when a master needs reading now.
    changed: Arc<Notify>,
    metrics: Arc<EvictionMetrics>,
}

impl EvictionGuard {
    /// Starts the periodic check (every `interval`; masters not checked yet
    /// every second); it ends with the last reference to the guard.
    pub fn start(
        wording: Wording,
        allow: bool,
        quorum: Option<usize>,
        timeout: Duration,
        interval: Duration,
        metrics: Arc<EvictionMetrics>,
    ) -> Arc<EvictionGuard> {
        metrics.allowed.set(i64::from(allow));
        if allow {
            tracing::warn!(
                setting = wording.setting,
                "eviction check is advisory: a Redis master that may evict live lock entries is only warned about (PITFALLS 14, docs/backends.md)"
            );
        }
        let guard = Arc::new(EvictionGuard {
            wording,
            allow,
            quorum,
            timeout,
            servers: Mutex::new(Vec::new()),
            reading: tokio::sync::Mutex::new(()),
            changed: Arc::new(Notify::new()),
            metrics,
        });
        tokio::spawn(watch(
            Arc::downgrade(&guard),
            guard.changed.clone(),
            interval,
        ));
        guard
    }

    /// The masters in use now, as `(host:port, metric label, connection)`.
    /// Masters already known keep what was read from them; new ones are
    /// read at once.
    pub fn set_servers(&self, servers: Vec<(String, String, Target)>) {
        {
            let mut current = self.servers.lock().expect("eviction lock");
            let next = servers
                .into_iter()
                .map(|(name, label, target)| {
                    let state = current
                        .iter()
                        .find(|s| s.name == name)
                        .map_or_else(State::fresh, |s| s.state.clone());
                    Server {
                        name,
                        label,
                        target,
                        state,
                    }
                })
                .collect();
            *current = next;
            self.export(&current);
        }
        self.changed.notify_one();
    }

    /// A connection to `name` (every master: `None`) failed: what it says
    /// after the reconnect is read again before it is trusted.
    pub fn invalidate(&self, name: Option<&str>) {
        let mut any = false;
        {
            let mut servers = self.servers.lock().expect("eviction lock");
            for s in servers.iter_mut() {
                if name.is_none_or(|n| n == s.name) && !matches!(s.state, State::Unchecked { .. }) {
                    s.state = State::fresh();
                    any = true;
                }
            }
            if any {
                self.export(&servers);
            }
        }
        if any {
            self.changed.notify_one();
        }
    }

    /// Whether lock entries may be written now: `Err` (naming the server
    /// and its policy) when a master may evict them, unless `allow_eviction`.
    /// `Ok` says, per master in order, whether it may take part (RedLock:
    /// a master not checked yet does not vote).
    pub async fn admit(&self) -> Result<Vec<bool>, BackendError> {
        if self.allow {
            let n = self.servers.lock().expect("eviction lock").len();
            return Ok(vec![true; n]);
        }
        if self.due_inline() {
            self.read(false).await;
        }
        let servers = self.servers.lock().expect("eviction lock");
        if servers.is_empty() && self.quorum.is_none() {
            return Err(BackendError::Unavailable(format!(
                "no {} master known yet to check maxmemory-policy on",
                self.wording.what
            )));
        }
        let mut usable = Vec::with_capacity(servers.len());
        for s in servers.iter() {
            match &s.state {
                State::Read(p) if p.name == SAFE_POLICY => usable.push(true),
                State::Read(p) => return Err(self.refusal_unsafe(s, p)),
                State::Unreadable(e) => return Err(self.refusal_unreadable(s, e)),
                State::Unchecked { error, .. } if self.quorum.is_none() => {
                    return Err(BackendError::Unavailable(format!(
                        "{} {}: maxmemory-policy not read yet{}",
                        self.wording.what,
                        s.name,
                        error
                            .as_deref()
                            .map(|e| format!(" ({e})"))
                            .unwrap_or_default()
                    )))
                }
                State::Unchecked { .. } => usable.push(false),
            }
        }
        Ok(usable)
    }

    /// Whether an acquire should read unchecked masters first: one has
    /// not been tried in the last [`INLINE_RETRY`] and (RedLock) fewer
    /// than a majority are known safe.
    fn due_inline(&self) -> bool {
        let servers = self.servers.lock().expect("eviction lock");
        if let Some(q) = self.quorum {
            if servers.iter().filter(|s| s.state.safe()).count() >= q {
                return false;
            }
        }
        servers.iter().any(|s| match s.state {
            State::Unchecked { tried, .. } => tried.is_none_or(|t| t.elapsed() >= INLINE_RETRY),
            _ => false,
        })
    }

    fn refusal_unsafe(&self, s: &Server, p: &Policy) -> BackendError {
        BackendError::Unavailable(format!(
            "{} {} has maxmemory-policy {} (maxmemory {}): it can evict live lock entries and grant a held lock again; set maxmemory-policy noeviction (docs/backends.md), or {} = true to accept that",
            self.wording.what, s.name, p.name, p.maxmemory, self.wording.setting
        ))
    }

    fn refusal_unreadable(&self, s: &Server, error: &str) -> BackendError {
        BackendError::Unavailable(format!(
            "{} {}: cannot read maxmemory-policy ({error}); allow INFO for fencer's user, or set {} = true",
            self.wording.what, s.name, self.wording.setting
        ))
    }

    /// Reads the policy of every master (`all`) or of those not checked
    /// yet, and records what they said.
    async fn read(&self, all: bool) {
        let _one = self.reading.lock().await;
        let todo: Vec<(String, Target)> = self
            .servers
            .lock()
            .expect("eviction lock")
            .iter()
            .filter(|s| all || matches!(s.state, State::Unchecked { .. }))
            .map(|s| (s.name.clone(), s.target.clone()))
            .collect();
        if todo.is_empty() {
            return;
        }
        let answers =
            futures_util::future::join_all(todo.into_iter().map(|(name, mut target)| async move {
                (name, read_policy(&mut target, self.timeout).await)
            }))
            .await;
        let mut servers = self.servers.lock().expect("eviction lock");
        for (name, answer) in answers {
            // The set may have changed while we read: match by name.
            let Some(s) = servers.iter_mut().find(|s| s.name == name) else {
                continue;
            };
            let before = s.state.clone();
            s.state = match answer {
                Answer::Read(p) => State::Read(p),
                Answer::Unreadable(e) => State::Unreadable(e),
                // No answer says nothing new about a master read before:
                // it keeps that state (lock calls to it fail anyway), so an
                // unreachable cluster shard does not stop the others. What
                // a reconnect may change is handled by `invalidate`.
                Answer::Failed(e) => {
                    tracing::debug!(server = %s.name, error = %e, "cannot read maxmemory-policy now");
                    match &s.state {
                        State::Unchecked { .. } => State::Unchecked {
                            error: Some(e),
                            tried: Some(Instant::now()),
                        },
                        known => known.clone(),
                    }
                }
            };
            self.log(s, &before);
        }
        self.export(&servers);
    }

    /// A line for every check that found a master unsafe (warn with the
    /// opt-out, error without: the backend refuses), and one when a master
    /// turns safe.
    fn log(&self, s: &Server, before: &State) {
        let setting = self.wording.setting;
        match &s.state {
            State::Read(p) if p.name == SAFE_POLICY => {
                if !before.safe() {
                    tracing::info!(server = %s.name, maxmemory = p.maxmemory, "redis maxmemory-policy is noeviction");
                }
            }
            State::Read(p) if self.allow => tracing::warn!(
                server = %s.name,
                policy = %p.name,
                maxmemory = p.maxmemory,
                setting,
                "redis may evict live lock entries (a second holder while the first still holds); allowed by the setting"
            ),
            State::Read(p) => tracing::error!(
                server = %s.name,
                policy = %p.name,
                maxmemory = p.maxmemory,
                "redis may evict live lock entries: backend not ready, acquires refused until maxmemory-policy is noeviction"
            ),
            State::Unreadable(e) if self.allow => tracing::warn!(
                server = %s.name,
                error = %e,
                setting,
                "cannot read redis maxmemory-policy; allowed by the setting"
            ),
            State::Unreadable(e) => tracing::error!(
                server = %s.name,
                error = %e,
                "cannot read redis maxmemory-policy (INFO and CONFIG refused): backend not ready, acquires refused"
            ),
            State::Unchecked { .. } => {}
        }
    }

    fn export(&self, servers: &[Server]) {
        let m = &self.metrics;
        let mut labels: Vec<(&str, bool)> = Vec::new();
        for s in servers {
            match labels.iter_mut().find(|(l, _)| *l == s.label) {
                Some((_, safe)) => *safe &= s.state.safe(),
                None => labels.push((&s.label, s.state.safe())),
            }
        }
        for (label, safe) in labels {
            m.safe.with_label_values(&[label]).set(i64::from(safe));
        }
        for p in POLICIES.iter().chain(&["unknown", "other"]) {
            let n = servers
                .iter()
                .filter(|s| s.state.policy_label() == *p)
                .count();
            m.policies.with_label_values(&[p]).set(n as i64);
        }
    }
}

/// Reads every master every `interval`, and those not checked yet every
/// second or as soon as they are added or invalidated.
async fn watch(guard: Weak<EvictionGuard>, changed: Arc<Notify>, interval: Duration) {
    let mut last_full: Option<Instant> = None;
    loop {
        let Some(g) = guard.upgrade() else { return };
        let all = last_full.is_none_or(|t| t.elapsed() >= interval);
        g.read(all).await;
        if all {
            last_full = Some(Instant::now());
        }
        drop(g);
        tokio::select! {
            _ = tokio::time::sleep(interval.min(RETRY_UNCHECKED)) => {}
            _ = changed.notified() => {}
        }
    }
}

enum Answer {
    Read(Policy),
    /// The server refused both ways of asking.
    Unreadable(String),
    /// No answer (connection, timeout): try again later.
    Failed(String),
}

/// `INFO memory`, else `CONFIG GET maxmemory-policy maxmemory`.
async fn read_policy(target: &mut Target, timeout: Duration) -> Answer {
    let answer = ask_policy(target, timeout).await;
    if crate::mutants::active("eviction_unchecked") {
        // The check switched off: whatever the server said, it "said"
        // noeviction (no answer at all stays no answer).
        return match answer {
            Answer::Read(p) => Answer::Read(Policy {
                name: SAFE_POLICY.into(),
                ..p
            }),
            Answer::Unreadable(_) => Answer::Read(Policy {
                name: SAFE_POLICY.into(),
                maxmemory: 0,
            }),
            failed => failed,
        };
    }
    answer
}

async fn ask_policy(target: &mut Target, timeout: Duration) -> Answer {
    let mut info = redis::cmd("INFO");
    info.arg("memory");
    let info_error = match tokio::time::timeout(timeout, target.command::<String>(&info)).await {
        Err(_) => return Answer::Failed("INFO memory timed out".into()),
        Ok(Ok(text)) => match parse_info(&text) {
            Some(p) => return Answer::Read(p),
            None => "INFO memory has no maxmemory_policy".to_owned(),
        },
        Ok(Err(e)) if e.code().is_none() => return Answer::Failed(e.to_string()),
        Ok(Err(e)) => format!("INFO memory: {e}"),
    };
    let mut config = redis::cmd("CONFIG");
    config.arg("GET").arg("maxmemory-policy").arg("maxmemory");
    let reply = tokio::time::timeout(
        timeout,
        target.command::<std::collections::HashMap<String, String>>(&config),
    )
    .await;
    match reply {
        Err(_) => Answer::Failed("CONFIG GET timed out".into()),
        Ok(Ok(fields)) => match fields.get("maxmemory-policy") {
            Some(name) => Answer::Read(Policy {
                name: name.to_ascii_lowercase(),
                maxmemory: fields
                    .get("maxmemory")
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(0),
            }),
            None => Answer::Unreadable(format!("{info_error}; CONFIG GET: no maxmemory-policy")),
        },
        Ok(Err(e)) if e.code().is_none() => Answer::Failed(e.to_string()),
        Ok(Err(e)) => Answer::Unreadable(format!("{info_error}; CONFIG GET: {e}")),
    }
}

/// `maxmemory` and `maxmemory_policy` from an `INFO memory` text.
fn parse_info(text: &str) -> Option<Policy> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.trim_end().strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    Some(Policy {
        name: field("maxmemory_policy")?.to_ascii_lowercase(),
        maxmemory: field("maxmemory").and_then(|m| m.parse().ok()).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_memory_gives_the_policy_and_the_limit() {
        let text = "# Memory\r\nused_memory:1043232\r\nmaxmemory:104857600\r\nmaxmemory_human:100.00M\r\nmaxmemory_policy:volatile-lru\r\nallocator_frag_ratio:1.2\r\n";
        assert_eq!(
            parse_info(text),
            Some(Policy {
                name: "volatile-lru".into(),
                maxmemory: 104_857_600
            })
        );
        // `maxmemory_human` and `maxmemory_policy` share the prefix.
        let text = "maxmemory_policy:noeviction\nmaxmemory:0\n";
        assert_eq!(
            parse_info(text),
            Some(Policy {
                name: "noeviction".into(),
                maxmemory: 0
            })
        );
        assert_eq!(parse_info("# Memory\r\nused_memory:1\r\n"), None);
    }

    #[test]
    fn only_noeviction_is_safe_and_labels_stay_bounded() {
        let read = |name: &str| {
            State::Read(Policy {
                name: name.into(),
                maxmemory: 0,
            })
        };
        assert!(read("noeviction").safe());
        for p in &POLICIES[1..] {
            assert!(!read(p).safe(), "{p}");
            assert_eq!(read(p).policy_label(), *p);
        }
        assert_eq!(read("made-up-lru").policy_label(), "other");
        assert_eq!(State::fresh().policy_label(), "unknown");
        assert!(!State::Unreadable("denied".into()).safe());
    }
}
