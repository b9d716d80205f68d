//! The ZooKeeper backend: Curator's lock recipe with a fencing token the
//! ensemble's consensus orders.
//!
//! A contender creates an ephemeral-sequential node under the key's
//! container node ([`queue`]); the lowest sequence holds, every other
//! contender watches only the node just ahead of it. A lease ends when
//! its holder releases, when its TTL passes without a renewal (this
//! backend deletes the node: ZooKeeper has no TTL for ephemeral nodes), or
//! when the sidecar's session expires (the ensemble deletes every node of
//! it, [`session`]). The first two happen on the sidecar's clock, the
//! third on the ensemble's — which is why no lease may outlast
//! [`settings::max_lease`] of the session: the sidecar's local deadline
//! then always comes first.
//!
//! A sidecar that dies (`kill -9`, a lost node) deletes nothing, and its
//! session — with every node of it, holding or waiting — lives on for the
//! session timeout. So every node also carries a lease-expiry record on
//! the ensemble's clock ([`expiry`]): its life, counted from its last
//! write's `mtime`. Holders refresh it with each renewal, waiters with a
//! keepalive, and the node's successor deletes it (version-checked) once
//! the record says it is dead: a dead sidecar's keys are free after the
//! TTL (+ lock-delay), not the session timeout.
//!
//! One acquire *try* is bounded as a whole by `request_timeout_ms`: every
//! call of it gets what is left of that budget, and none is sent once it
//! is spent.
//!
//! The token is the holder node's creation zxid plus the token offset in
//! force when the node was created (a multi checks the offset node's
//! version with the create, and the offset goes into the node's data).
//! zxids are assigned by the leader in commit order and their high 32 bits
//! are the leader's epoch, so they increase across leader changes; nodes of
//! one queue are created, and so hold, in zxid order; the offset only grows
//! (a repair raises it, `raise_token_floor`). (The sequence number in the
//! name is *not* a safe token: a per-parent counter that restarts when the
//! container is recreated.)
//!
//! Every acquisition rests on a *write* sent during the try that returns
//! it: the create itself on the fast path, otherwise a `setData` stamping
//! the lease id into the node once it is first. A read alone could be
//! served by a follower that lags or has lost the leader; a write commits
//! through the leader, fails once the session is gone, and so proves the
//! session alive after the try began. Renewals are writes for the same
//! reason.
//!
//! Each sidecar keeps at most one node per key. Its local FIFO sends only
//! the head waiter to the backend, and each try uses a new lease id, so the
//! node outlives a lease id: it belongs to the newest one that tried, and
//! releasing an older id leaves it alone. A waiter that gives up releases
//! its lease id, which deletes the node ([`LockBackend::held_keeps_a_place`]).
//!
//! A read lease (read-write locks) is a node of its own, with a reader's
//! ticket, in the same queue: its entry is keyed by the reader's
//! [`LockKey`], and it holds once no write node is ahead of it
//! ([`queue`]). Its token is its node's creation zxid plus offset, as a
//! writer's: since a writer holds only as the lowest node and a reader
//! only with no writer ahead, each token is above every token of a lease
//! it had to wait for. Readers let in together (a writer's release) may be
//! told "held" in any order among themselves: they do not fence each
//! other. A reader keeps no lock-delay after its TTL, as on every backend.

pub mod expiry;
pub mod holds;
pub mod queue;
pub mod session;
pub mod settings;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;
use tokio::time::Instant;
use zookeeper_client as zk;

use self::expiry::{NodeData, Record, ServerTime};
use self::queue::Place;
use self::session::{call, read_offset, Connect, Failed, Session, Sessions};
use self::settings::{max_lease, ZooKeeperSettings};
use super::{
    Attempt, BackendError, HolderView, Holds, HoldsChange, KeyView, LeaseId, LockBackend, LockKey,
    Ownership, WakeSink, WatchGuard,
};
use crate::metrics::zookeeper::ZooKeeperMetrics;

/// How often expired leases and failed deletions are looked at. A node is
/// deleted at most this late (later is the safe side: the key stays
/// blocked a little longer).
const SWEEP_EVERY: Duration = Duration::from_millis(50);

/// Creates, lists and confirmations retried within one try when the
/// queue changed under us (a container removed, a predecessor gone).
const QUEUE_ROUNDS: usize = 4;

/// A waiter's keepalive or dead-node delete that failed is tried again
/// after this.
const RETRY_AFTER: Duration = Duration::from_millis(200);

/// What is left of a try's budget; an error once it is spent (no call is
/// sent then: its outcome would be unknown for nothing).
fn left(deadline: Instant) -> Result<Duration, BackendError> {
    let t = deadline.saturating_duration_since(Instant::now());
    if t.is_zero() {
        return Err(BackendError::Unavailable(
            "ZooKeeper acquire: the try's budget (backend.zookeeper.request_timeout_ms) ran out"
                .into(),
        ));
    }
    Ok(t)
}

pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

struct Inner {
    sessions: Arc<Sessions>,
    locks_dir: String,
    /// Semaphores' permit counts, one persistent node each.
    semaphores_dir: String,
    offset_path: String,
    acls: zk::Acls<'static>,
    timeout: Duration,
    lock_delay: Duration,
    /// `leader_clock_skew_ms`: added when a node's last write and ours were
    /// stamped by different leaders ([`expiry`]).
    skew: Duration,
    /// This sidecar's node per key (at most one).
    entries: Mutex<HashMap<LockKey, Entry>>,
    /// Nodes to delete whose deletion failed: (generation, key dir, ticket).
    doomed: Mutex<Vec<(u64, String, String)>>,
    wake: Arc<dyn WakeSink>,
    metrics: Arc<ZooKeeperMetrics>,
}

/// This sidecar's node in one key's queue.
struct Entry {
    generation: u64,
    ticket: String,
    /// Our node once a create or listing showed it.
    node: Option<Node>,
    /// The newest lease id that tried this node; only it may release it.
    lease: LeaseId,
    /// The node's life without a write (its lease-expiry record): the
    /// newest try's TTL + lock-delay.
    life: Duration,
    state: State,
    /// A hold count was written for the holding lease ([`holds`]): its
    /// release deletes the record too.
    holds_written: bool,
}

/// This sidecar's node in a key's queue, and the token offset it was
/// created under (written into its data: `<offset> <lease id>`).
#[derive(Debug, Clone)]
struct Node {
    name: String,
    offset: u64,
}

/// What [`Inner::ensure_node`] found.
struct Found {
    place: Place,
    node: Node,
    /// The node was created by this call — a write sent after the try
    /// began — and, when its reply carried one, its creation zxid.
    created: Option<Option<i64>>,
}

/// What became of the node ahead of ours.
enum Ahead {
    /// Still there: a task watches it (and keeps our node alive); the
    /// holder's delay window, if it is the holder ([`State::Waiting`]).
    Watching(Watch, Option<(Instant, Instant)>),
    /// Gone (deleted meanwhile, or by us as dead): list again.
    Gone,
}

/// What a keepalive of our own waiting node found.
enum Kept {
    /// Written; the node's life.
    Alive(Duration),
    /// Our node or entry is gone (deleted as dead by our successor, or the
    /// entry was released or now holds): nothing to keep alive.
    Gone,
    /// No answer in time, or an error (its text): try again soon.
    Failed(String),
}

/// The task waiting for a predecessor's deletion — and keeping our own
/// waiting node's expiry record fresh, and deleting the predecessor once
/// its own record says it is dead; ends with its entry (a waiter that gave
/// up leaves no task behind on a long-held key).
struct Watch(tokio::task::AbortHandle);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

enum State {
    /// Queued; `watching`: the predecessor a wake-up is armed on;
    /// `delay`: when the holder's lock-delay begins and ends on this
    /// process's clock, if the predecessor is the holder and its node says
    /// ([`waiting`]).
    Waiting {
        watching: Option<(String, Watch)>,
        delay: Option<(Instant, Instant)>,
    },
    /// Holds the key. `expires`: the node is deleted then unless renewed
    /// (TTL + lock-delay after the send time of the acquire or renewal).
    Held { token: u64, expires: Instant },
}

impl ZooKeeperBackend {
    pub fn new(
        settings: &ZooKeeperSettings,
        lock_delay: Duration,
        wake: Arc<dyn WakeSink>,
        registry: &prometheus::Registry,
    ) -> Result<ZooKeeperBackend, BackendError> {
        let metrics = Arc::new(ZooKeeperMetrics::new(registry));
        let acls = if settings.auth_digest.is_some() {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        };
        let sessions = Sessions::new(settings.session_timeout(), settings.hosts().join(","));
        let root = settings.root.clone();
        let inner = Arc::new(Inner {
            sessions: sessions.clone(),
            locks_dir: format!("{root}/locks"),
            semaphores_dir: format!("{root}/semaphores"),
            offset_path: format!("{root}/token-offset"),
            acls,
            timeout: settings.request_timeout(),
            lock_delay,
            skew: settings.leader_clock_skew(),
            entries: Mutex::new(HashMap::new()),
            doomed: Mutex::new(Vec::new()),
            wake: wake.clone(),
            metrics: metrics.clone(),
        });
        session::supervise(
            Connect {
                settings: settings.clone(),
                offset_path: inner.offset_path.clone(),
                root,
                acls,
            },
            sessions,
            wake,
            metrics,
        );
        sweep(Arc::downgrade(&inner));
        Ok(ZooKeeperBackend { inner })
    }
}

/// Deletes held nodes whose TTL passed and retries failed deletions, until
/// the backend is dropped.
fn sweep(weak: std::sync::Weak<Inner>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(inner) = weak.upgrade() else { return };
            inner.sweep_once().await;
        }
    });
}

impl Inner {
    async fn sweep_once(&self) {
        let now = Instant::now();
        let generation = self.sessions.generation();
        let mut expired = Vec::new();
        {
            let mut entries = self.entries.lock().expect("entries");
            entries.retain(|key, e| {
                if Some(e.generation) != generation {
                    // Gone with its session (nothing to delete).
                    return generation.is_none();
                }
                match e.state {
                    State::Held { expires, token } if expires <= now => {
                        expired.push((key.clone(), e.ticket.clone(), token));
                        false
                    }
                    _ => true,
                }
            });
            self.count_queue(&entries);
        }
        for (key, ticket, token) in expired {
            self.metrics.lease_expiries.inc();
            tracing::info!(key = %key, token, "lease TTL passed without renewal; deleting its ZooKeeper node");
            if let Some(g) = generation {
                self.doom(g, &key, ticket);
            }
            self.wake.released(key.as_str());
        }
        let doomed = std::mem::take(&mut *self.doomed.lock().expect("doomed"));
        if doomed.is_empty() {
            return;
        }
        let Ok(session) = self.sessions.current() else {
            return; // dropped: their session is gone, and so are the nodes
        };
        for (g, dir, ticket) in doomed {
            if g != session.generation {
                continue;
            }
            if let Err(e) = self.delete_ticket(&session, &dir, &ticket).await {
                self.metrics.cleanup_retries.inc();
                tracing::warn!(error = %e, "could not delete a ZooKeeper lock node; retrying");
                self.doomed.lock().expect("doomed").push((g, dir, ticket));
            }
        }
    }

    fn doom(&self, generation: u64, key: &LockKey, ticket: String) {
        let dir = queue::key_dir(&self.locks_dir, key.as_str());
        self.doomed
            .lock()
            .expect("doomed")
            .push((generation, dir, ticket));
    }

    fn count_queue(&self, entries: &HashMap<LockKey, Entry>) {
        let waiting = entries
            .values()
            .filter(|e| matches!(e.state, State::Waiting { .. }))
            .count();
        self.metrics.queue_nodes.set(waiting as i64);
    }

    /// Deletes every node of `ticket` in `dir` (normally one).
    async fn delete_ticket(
        &self,
        s: &Session,
        dir: &str,
        ticket: &str,
    ) -> Result<(), BackendError> {
        let children = match call(self.timeout, s.client.list_children(dir)).await {
            Ok(c) => c,
            Err(Failed::Zk(zk::Error::NoNode)) => return Ok(()),
            Err(e) => return Err(e.into_backend("list")),
        };
        for c in children
            .iter()
            .filter(|c| c.rsplit_once('-').is_some_and(|(t, _)| t == ticket))
        {
            self.delete_node(s, &format!("{dir}/{c}"), self.timeout)
                .await?;
        }
        Ok(())
    }

    async fn delete_node(&self, s: &Session, path: &str, t: Duration) -> Result<(), BackendError> {
        match call(t, s.client.delete(path, None)).await {
            Ok(()) | Err(Failed::Zk(zk::Error::NoNode)) => Ok(()),
            Err(e) => Err(e.into_backend("delete")),
        }
    }

    /// Finds or creates `ticket`'s node in `dir` and its place in the queue.
    ///
    /// The create is a multi that also checks the token offset's version,
    /// so the offset written into the node is the current one at its
    /// creation: tokens are `czxid + offset at creation`, and both only
    /// grow along the queue.
    #[allow(clippy::too_many_arguments)]
    async fn ensure_node(
        &self,
        s: &Session,
        dir: &str,
        ticket: &str,
        lease: &LeaseId,
        life: Duration,
        known: Option<Node>,
        look: bool,
        deadline: Instant,
    ) -> Result<Found, BackendError> {
        let container = zk::CreateMode::Container.with_acls(self.acls);
        let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(self.acls);
        // A create whose answer was lost may have happened: look first
        // (only then — a fresh ticket cannot be there).
        let mut look = look;
        let mut created: Option<(Node, Option<i64>)> = None;
        for _ in 0..QUEUE_ROUNDS {
            if look {
                match call(left(deadline)?, s.client.list_children(dir)).await {
                    Ok(children) => {
                        let (place, extra) = queue::place(&children, ticket);
                        for x in extra {
                            self.delete_node(s, &format!("{dir}/{x}"), left(deadline)?)
                                .await?;
                        }
                        let name = match &place {
                            Place::Absent => None,
                            Place::First { name } | Place::Behind { name, .. } => {
                                Some(name.clone())
                            }
                        };
                        if let Some(name) = name {
                            if let Some((node, czxid)) =
                                created.take().filter(|(n, _)| n.name == name)
                            {
                                return Ok(Found {
                                    place,
                                    node,
                                    created: Some(czxid),
                                });
                            }
                            let offset = match &known {
                                Some(n) if n.name == name => n.offset,
                                _ => match self
                                    .node_offset(s, &format!("{dir}/{name}"), deadline)
                                    .await?
                                {
                                    Some(o) => o,
                                    None => continue, // gone meanwhile
                                },
                            };
                            return Ok(Found {
                                place,
                                node: Node { name, offset },
                                created: None,
                            });
                        }
                        created = None;
                    }
                    Err(Failed::Zk(zk::Error::NoNode)) => {}
                    Err(e) => return Err(e.into_backend("list")),
                }
            }
            look = true;
            let (offset, version) = *s.offset.lock().expect("offset");
            let delay = self.delay_of(queue::is_read_node(ticket));
            let data = NodeData::encode(offset, lease.as_str(), life, delay);
            let mut multi = s.client.new_multi_writer();
            multi
                .add_check_version(&self.offset_path, version)
                .and_then(|()| {
                    multi.add_create(
                        &queue::node_prefix(dir, ticket),
                        data.as_bytes(),
                        &ephemeral,
                    )
                })
                .map_err(|e| BackendError::Protocol(e.to_string()))?;
            match call(left(deadline)?, async {
                multi.commit().await.map_err(zk::Error::from)
            })
            .await
            {
                Ok(results) => {
                    created = results.into_iter().find_map(|r| match r {
                        zk::MultiWriteResult::Create { path, stat } => {
                            let name = path.rsplit('/').next().unwrap_or_default().to_owned();
                            let full = stat.czxid > 0;
                            if full {
                                s.saw(&stat);
                            }
                            Some((Node { name, offset }, full.then_some(stat.czxid)))
                        }
                        _ => None,
                    });
                }
                Err(Failed::Zk(zk::Error::BadVersion)) => {
                    // Another sidecar raised the offset: read it, try again.
                    *s.offset.lock().expect("offset") =
                        read_offset(&s.client, &self.offset_path, left(deadline)?).await?;
                    look = false;
                }
                Err(Failed::Zk(zk::Error::NoNode)) => {
                    // The key's container is missing (first use, or
                    // ZooKeeper removed it when its last child went).
                    match call(left(deadline)?, s.client.create(dir, b"", &container)).await {
                        Ok(_) | Err(Failed::Zk(zk::Error::NodeExists)) => {}
                        Err(e) => return Err(e.into_backend("create key node")),
                    }
                    look = false;
                }
                Err(e) => return Err(e.into_backend("create")),
            }
        }
        Err(BackendError::Unavailable(
            "ZooKeeper lock queue kept changing; try again".into(),
        ))
    }

    /// The token offset a node was created under (`None`: it is gone).
    async fn node_offset(
        &self,
        s: &Session,
        path: &str,
        deadline: Instant,
    ) -> Result<Option<u64>, BackendError> {
        match call(left(deadline)?, s.client.get_data(path)).await {
            Ok((data, _)) => NodeData::parse(&data)
                .map(|d| Some(d.offset))
                .ok_or_else(|| {
                    BackendError::Protocol(format!("{path}: no token offset in its data"))
                }),
            Err(Failed::Zk(zk::Error::NoNode)) => Ok(None),
            Err(e) => Err(e.into_backend("read node")),
        }
    }

    /// Our node stands behind `predecessor`: delete the predecessor if its
    /// lease-expiry record says it is dead, else arm the task that waits
    /// for it (and keeps our node alive meanwhile).
    #[allow(clippy::too_many_arguments)]
    async fn behind(
        self: &Arc<Self>,
        s: &Arc<Session>,
        key: &LockKey,
        ticket: &str,
        own: (&str, &str),
        dir: &str,
        (predecessor, first): (&str, bool),
        deadline: Instant,
    ) -> Result<Ahead, BackendError> {
        let path = format!("{dir}/{predecessor}");
        let (data, stat, watcher) =
            match call(left(deadline)?, s.client.get_and_watch_data(&path)).await {
                Ok(x) => x,
                Err(Failed::Zk(zk::Error::NoNode)) => return Ok(Ahead::Gone),
                Err(e) => return Err(e.into_backend("watch")),
            };
        let record = Record::of(&stat, &data);
        if let Some(r) = record {
            // Any write of ours stamps a time the ensemble has passed; if
            // the newest is not late enough but might be by now, write
            // again (our own node) for a fresh one.
            let now = Instant::now();
            let mut time = s.clock();
            if time.is_none_or(|(t, seen)| {
                !r.expired(t, self.skew) && r.check_at(t, seen, self.skew) <= now
            }) {
                let (own_path, own_data) = own;
                match call(
                    left(deadline)?,
                    s.client.set_data(own_path, own_data.as_bytes(), None),
                )
                .await
                {
                    Ok(stat) => {
                        s.saw(&stat);
                        time = s.clock();
                    }
                    // Our own node went (deleted as dead): list again.
                    Err(Failed::Zk(zk::Error::NoNode)) => return Ok(Ahead::Gone),
                    Err(e) => return Err(e.into_backend("keepalive")),
                }
            }
            if let Some((t, _)) = time.filter(|(t, _)| r.expired(*t, self.skew)) {
                self.delete_dead(s, key, &path, &r, t, left(deadline)?)
                    .await?;
                return Ok(Ahead::Gone);
            }
        }
        let window = holder_delay(s, first, record, self.skew);
        Ok(Ahead::Watching(
            self.guard(
                s.clone(),
                key.clone(),
                ticket.to_owned(),
                (path, first),
                watcher,
                record,
            ),
            window,
        ))
    }

    /// Deletes `lease`'s hold-count record under `dir`, at the version
    /// read (never a later holder's); a failure leaves it to the session's
    /// end, and a later lease counts it as none.
    async fn delete_holds(&self, s: &Session, dir: &str, lease: &LeaseId) {
        let path = format!("{dir}/{}", holds::NODE);
        if let Ok((data, stat)) = call(self.timeout, s.client.get_data(&path)).await {
            if holds::Record::parse(&data).is_some_and(|r| r.lease == lease.as_str()) {
                let _ = call(self.timeout, s.client.delete(&path, Some(stat.version))).await;
            }
        }
    }

    /// [`LockBackend::holds`] for a lease this sidecar holds (see [`holds`]).
    async fn change_holds(
        &self,
        s: &Session,
        key: &LockKey,
        lease: &LeaseId,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        let deadline = Instant::now() + self.timeout;
        let path = format!(
            "{}/{}",
            queue::key_dir(&self.locks_dir, key.as_str()),
            holds::NODE
        );
        let owned = |holds: u32, owner: &str, applied: bool| Holds::Owned {
            holds,
            owner: (!owner.is_empty()).then(|| owner.to_owned()),
            applied,
        };
        for _ in 0..3 {
            let (found, version) = match call(left(deadline)?, s.client.get_data(&path)).await {
                Ok((data, stat)) => (holds::Record::parse(&data), Some(stat.version)),
                Err(Failed::Zk(zk::Error::NoNode)) => (None, None),
                Err(e) => return Err(e.into_backend("read hold count")),
            };
            let mine = found.filter(|r| r.lease == lease.as_str());
            let (h, op, owner) = mine.map_or((1, String::new(), String::new()), |r| {
                (r.holds, r.op, r.owner)
            });
            let HoldsChange::Set {
                expect,
                to,
                owner: new_owner,
                op: new_op,
            } = change
            else {
                return Ok(owned(h, &owner, false));
            };
            if op == new_op {
                return Ok(owned(h, &owner, true));
            }
            if expect != h {
                return Ok(owned(h, &owner, false));
            }
            let t = left(deadline)?;
            let written = match (to, version) {
                (0, None) => Ok(()),
                (0, Some(v)) => call(t, s.client.delete(&path, Some(v))).await,
                (_, Some(v)) => {
                    let data = holds::Record::encode(lease.as_str(), to, new_op, new_owner);
                    call(t, s.client.set_data(&path, data.as_bytes(), Some(v)))
                        .await
                        .map(|_| ())
                }
                (_, None) => {
                    let data = holds::Record::encode(lease.as_str(), to, new_op, new_owner);
                    let ephemeral = zk::CreateMode::Ephemeral.with_acls(self.acls);
                    call(t, s.client.create(&path, data.as_bytes(), &ephemeral))
                        .await
                        .map(|_| ())
                }
            };
            match written {
                Ok(()) => {
                    if let Some(e) = self.entries.lock().expect("entries").get_mut(key) {
                        if e.lease == *lease {
                            e.holds_written = true;
                        }
                    }
                    return Ok(owned(to, new_owner, true));
                }
                // Changed under us (a record of an earlier session going,
                // or appearing): read again.
                Err(Failed::Zk(
                    zk::Error::BadVersion | zk::Error::NodeExists | zk::Error::NoNode,
                )) => continue,
                Err(e) => return Err(e.into_backend("write hold count")),
            }
        }
        Err(BackendError::Unavailable(
            "ZooKeeper: the hold-count record changed under three tries in a row".into(),
        ))
    }

    /// Deletes a node whose lease-expiry record passed at `now`, at the
    /// version the record was read with (a refresh that got there first
    /// wins). Whatever the outcome, the caller looks at the queue again.
    async fn delete_dead(
        &self,
        s: &Session,
        key: &LockKey,
        path: &str,
        r: &Record,
        now: ServerTime,
        t: Duration,
    ) -> Result<(), BackendError> {
        match call(t, s.client.delete(path, Some(r.version))).await {
            Ok(()) => {
                self.metrics.dead_nodes_deleted.inc();
                tracing::warn!(key = %key, node = %path.rsplit('/').next().unwrap_or_default(),
                    last_write_ms = r.written.ms, life_ms = r.life_ms, ensemble_now_ms = now.ms,
                    "deleted a ZooKeeper lock node whose lease-expiry record passed (its sidecar stopped refreshing it: dead, frozen or cut off)");
                Ok(())
            }
            // Refreshed meanwhile (alive after all), or gone already.
            Err(Failed::Zk(zk::Error::BadVersion | zk::Error::NoNode)) => Ok(()),
            Err(e) => Err(e.into_backend("delete dead node")),
        }
    }

    /// Spawns the task for a waiting entry: it wakes the waiter when the
    /// predecessor goes, keeps our node's expiry record fresh (every
    /// quarter of its life), and deletes the predecessor once its record
    /// says it is dead.
    fn guard(
        self: &Arc<Self>,
        s: Arc<Session>,
        key: LockKey,
        ticket: String,
        (path, first): (String, bool),
        watcher: zk::OneshotWatcher,
        record: Option<Record>,
    ) -> Watch {
        let weak = Arc::downgrade(self);
        let (wake, skew, timeout) = (self.wake.clone(), self.skew, self.timeout);
        let first_life = self
            .with_entry(&key, &ticket, |e| e.life)
            .unwrap_or(Duration::from_secs(1));
        let task = tokio::spawn(async move {
            let mut changed = Box::pin(watcher.changed());
            let mut record = record;
            let mut keepalive_at = Instant::now() + first_life / 4;
            // After a failed keepalive or delete: not before this.
            let mut not_before = Instant::now();
            // Failures in a row: the first is logged as a warning, the
            // rest (a disconnect retried every RETRY_AFTER) at debug.
            let mut failing = 0u32;
            loop {
                let check_at = record
                    .zip(s.clock())
                    .map(|(r, (t, seen))| r.check_at(t, seen, skew).max(not_before));
                tokio::select! {
                    event = &mut changed => {
                        // The holder's renewals and keepalives change the
                        // node's data, which fires the watch too: re-arm
                        // and read its new record. Only its deletion (or a
                        // session event) is news for the waiter.
                        if event.event_type != zk::EventType::NodeDataChanged {
                            break;
                        }
                        match call(timeout, s.client.get_and_watch_data(&path)).await {
                            Ok((data, stat, next)) => {
                                record = Record::of(&stat, &data);
                                changed = Box::pin(next.changed());
                                // A renewed holder: its delay moved too.
                                let Some(inner) = weak.upgrade() else { return };
                                let window = holder_delay(&s, first, record, skew);
                                inner.with_entry(&key, &ticket, |e| {
                                    if let State::Waiting { delay, .. } = &mut e.state {
                                        *delay = window;
                                    }
                                });
                            }
                            _ => break,
                        }
                    }
                    _ = tokio::time::sleep_until(keepalive_at) => {
                        let Some(inner) = weak.upgrade() else { return };
                        match inner.keepalive(&s, &key, &ticket).await {
                            Kept::Alive(life) => {
                                failing = 0;
                                keepalive_at = Instant::now() + life / 4;
                            }
                            Kept::Gone => break,
                            Kept::Failed(e) => {
                                retrying(&mut failing, &key, "keepalive of a waiting ZooKeeper node", &e);
                                keepalive_at = Instant::now() + RETRY_AFTER;
                            }
                        }
                    }
                    _ = tokio::time::sleep_until(check_at.unwrap_or(keepalive_at)), if check_at.is_some() => {
                        let Some(inner) = weak.upgrade() else { return };
                        let Some(r) = record else { continue };
                        // A fresh time from the ensemble: our keepalive.
                        match inner.keepalive(&s, &key, &ticket).await {
                            Kept::Alive(life) => {
                                failing = 0;
                                keepalive_at = Instant::now() + life / 4;
                            }
                            Kept::Gone => break,
                            Kept::Failed(e) => {
                                retrying(&mut failing, &key, "keepalive of a waiting ZooKeeper node", &e);
                                not_before = Instant::now() + RETRY_AFTER;
                                continue;
                            }
                        }
                        let Some((now, _)) = s.clock() else { continue };
                        if !r.expired(now, skew) {
                            continue; // not yet on the ensemble's clock: check again later
                        }
                        match inner.delete_dead(&s, &key, &path, &r, now, timeout).await {
                            // Deleted, refreshed meanwhile or gone: look again.
                            Ok(()) => match call(timeout, s.client.get_data(&path)).await {
                                Ok((data, stat)) => record = Record::of(&stat, &data),
                                _ => break,
                            },
                            Err(e) => {
                                retrying(&mut failing, &key, "deleting a dead ZooKeeper lock node", &e.to_string());
                                not_before = Instant::now() + RETRY_AFTER;
                            }
                        }
                    }
                }
            }
            wake.released(key.as_str());
        });
        Watch(task.abort_handle())
    }

    /// Refreshes our waiting node's lease-expiry record (and learns the
    /// ensemble's time from the write).
    async fn keepalive(&self, s: &Session, key: &LockKey, ticket: &str) -> Kept {
        let dir = queue::key_dir(&self.locks_dir, key.as_str());
        let what = self.with_entry(key, ticket, |e| match (&e.state, &e.node) {
            (State::Waiting { .. }, Some(node)) if e.generation == s.generation => Some((
                format!("{dir}/{}", node.name),
                NodeData::encode(
                    node.offset,
                    e.lease.as_str(),
                    e.life,
                    self.delay_of(key.is_reader()),
                ),
                e.life,
            )),
            _ => None,
        });
        let Some((path, data, life)) = what.flatten() else {
            return Kept::Gone;
        };
        let result = match call(
            self.timeout,
            s.client.set_data(&path, data.as_bytes(), None),
        )
        .await
        {
            Ok(stat) => {
                s.saw(&stat);
                Kept::Alive(life)
            }
            Err(Failed::Zk(zk::Error::NoNode)) => {
                tracing::info!(key = %key, "our waiting ZooKeeper node was deleted as dead (its keepalive came too late); queueing again");
                Kept::Gone
            }
            Err(e) => Kept::Failed(e.into_backend("keepalive").to_string()),
        };
        let label = match result {
            Kept::Alive(_) => "ok",
            Kept::Gone => "node_gone",
            Kept::Failed(_) => "error",
        };
        self.metrics.keepalives.with_label_values(&[label]).inc();
        result
    }

    /// Stamps `lease` into our node, first in the queue: the write that
    /// makes an acquisition real when the node was created by an earlier
    /// try (see the module comment). Returns its creation zxid.
    async fn confirm(
        &self,
        s: &Session,
        path: &str,
        data: &str,
        deadline: Instant,
    ) -> Result<i64, BackendError> {
        match call(
            left(deadline)?,
            s.client.set_data(path, data.as_bytes(), None),
        )
        .await
        {
            Ok(stat) => {
                s.saw(&stat);
                Ok(stat.czxid)
            }
            Err(Failed::Zk(zk::Error::NoNode)) => Err(BackendError::Unavailable(
                "our ZooKeeper lock node vanished".into(),
            )),
            Err(e) => Err(e.into_backend("confirm")),
        }
    }

    /// The lock-delay a lease of `key` keeps after its TTL: a writer's
    /// (`sidecar.lock_delay_ms`); none for a reader's, as on every backend.
    fn delay_of(&self, reader: bool) -> Duration {
        if reader {
            Duration::ZERO
        } else {
            self.lock_delay
        }
    }

    /// Our node in `key`'s entry, when it is still the one `ticket` names.
    fn with_entry<T>(
        &self,
        key: &LockKey,
        ticket: &str,
        f: impl FnOnce(&mut Entry) -> T,
    ) -> Option<T> {
        let mut entries = self.entries.lock().expect("entries");
        entries.get_mut(key).filter(|e| e.ticket == ticket).map(f)
    }

    /// Forgets `key`'s entry if it is still `ticket`'s.
    fn forget(&self, key: &LockKey, ticket: &str) {
        let mut entries = self.entries.lock().expect("entries");
        if entries.get(key).is_some_and(|e| e.ticket == ticket) {
            entries.remove(key);
        }
        self.count_queue(&entries);
    }
}

/// Logs a failure the guard retries: the first of a streak as a warning,
/// the rest (a disconnect retried every [`RETRY_AFTER`]) at debug.
fn retrying(failing: &mut u32, key: &LockKey, what: &str, error: &str) {
    *failing += 1;
    if *failing == 1 {
        tracing::warn!(key = %key, error, "{what} failed; retrying");
    } else {
        tracing::debug!(key = %key, error, failures = *failing, "{what} failed again; retrying");
    }
}

/// What a waiter is told while its node waits: `lock_delayed` while the
/// holder's lock-delay lasts (its TTL ran out, its node not yet dead),
/// else `lock_held` — with the time to the delay's start, so the waiter
/// looks again then.
fn waiting(delay: Option<(Instant, Instant)>) -> Attempt {
    let now = Instant::now();
    match delay {
        Some((start, end)) if now >= start && now < end => Attempt::Delayed {
            remaining: end - now,
        },
        Some((start, _)) if now < start => Attempt::Held {
            remaining: Some(start - now),
        },
        _ => Attempt::Held { remaining: None },
    }
}

/// The holder's delay window from its node's record, if the node ahead is
/// the holder, records a delay, and the ensemble's time is known.
fn holder_delay(
    s: &Session,
    first: bool,
    record: Option<Record>,
    skew: Duration,
) -> Option<(Instant, Instant)> {
    let r = record.filter(|r| first && r.delay_ms > 0)?;
    let (sample, seen) = s.clock()?;
    Some(r.delay_window(sample, seen, skew))
}

/// How long after the send of an acquire or renewal its node may live
/// without another renewal: the TTL (the holder's local deadline is
/// earlier still: drift and safety margin) plus the lock-delay.
fn node_life(ttl: Duration, lock_delay: Duration) -> Duration {
    if crate::mutants::active("zk_early_expiry") {
        return ttl / 2;
    }
    ttl + lock_delay
}

fn token_of(czxid: i64, offset: u64) -> Result<u64, BackendError> {
    u64::try_from(czxid)
        .ok()
        .and_then(|z| z.checked_add(offset))
        .ok_or_else(|| {
            BackendError::Protocol(format!("zxid {czxid} + offset {offset} is no token"))
        })
}

#[async_trait]
impl LockBackend for ZooKeeperBackend {
    fn name(&self) -> &'static str {
        "zookeeper"
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Attempt, BackendError> {
        let inner = &self.inner;
        let sent = Instant::now();
        // The whole try, every call of it, within one request timeout.
        let deadline = sent + inner.timeout;
        let life = node_life(ttl, inner.delay_of(key.is_reader()));
        let s = inner.sessions.current()?;
        let (ticket, known, look) = {
            let mut entries = inner.entries.lock().expect("entries");
            if entries
                .get(key)
                .is_some_and(|e| e.generation != s.generation)
            {
                entries.remove(key);
            }
            // An entry that exists already may have sent a create whose
            // answer never came: look for its node before creating one.
            let known = entries.contains_key(key);
            let entry = entries.entry(key.clone()).or_insert_with(|| Entry {
                generation: s.generation,
                ticket: if key.is_reader() {
                    queue::read_ticket()
                } else {
                    queue::new_ticket()
                },
                node: None,
                lease: lease.clone(),
                life,
                state: State::Waiting {
                    watching: None,
                    delay: None,
                },
                holds_written: false,
            });
            match entry.state {
                State::Held { token, .. } if entry.lease == *lease => {
                    return Ok(Attempt::Acquired { token });
                }
                State::Held { expires, .. } => {
                    // Another lease of this sidecar holds it, or held it:
                    // its node lives on through the lock-delay.
                    let delay = inner.delay_of(key.is_reader());
                    return Ok(waiting(Some((
                        expires.checked_sub(delay).unwrap_or(expires),
                        expires,
                    ))));
                }
                State::Waiting { .. } => {
                    entry.lease = lease.clone();
                    entry.life = life;
                    (entry.ticket.clone(), entry.node.clone(), known)
                }
            }
        };
        inner.count_queue(&inner.entries.lock().expect("entries"));
        let dir = queue::key_dir(&inner.locks_dir, key.as_str());
        for _ in 0..QUEUE_ROUNDS {
            let found = inner
                .ensure_node(
                    &s,
                    &dir,
                    &ticket,
                    lease,
                    life,
                    known.clone(),
                    look,
                    deadline,
                )
                .await?;
            let node = found.node.clone();
            let data = NodeData::encode(
                node.offset,
                lease.as_str(),
                life,
                inner.delay_of(key.is_reader()),
            );
            match found.place {
                Place::Absent => unreachable!("ensure_node returns our node"),
                Place::Behind {
                    predecessor, first, ..
                } => {
                    let armed = inner.with_entry(key, &ticket, |e| {
                        let State::Waiting { watching, delay } = &mut e.state else {
                            return Some(None);
                        };
                        // A node of ours deleted as dead was replaced by a
                        // new one: this is the one.
                        e.node = Some(node.clone());
                        watching
                            .as_ref()
                            .is_some_and(|(p, w)| *p == predecessor && !w.0.is_finished())
                            .then_some(*delay)
                    });
                    match armed {
                        None => {
                            // Released meanwhile: the node we made is nobody's.
                            inner.doom(s.generation, key, ticket);
                            return Ok(Attempt::Held { remaining: None });
                        }
                        Some(Some(delay)) => return Ok(waiting(delay)),
                        Some(None) => {}
                    }
                    let own = format!("{dir}/{}", node.name);
                    match inner
                        .behind(
                            &s,
                            key,
                            &ticket,
                            (&own, &data),
                            &dir,
                            (&predecessor, first),
                            deadline,
                        )
                        .await?
                    {
                        Ahead::Watching(watch, window) => {
                            inner.with_entry(key, &ticket, |e| {
                                if let State::Waiting { watching, delay } = &mut e.state {
                                    *watching = Some((predecessor, watch));
                                    *delay = window;
                                }
                            });
                            return Ok(waiting(window));
                        }
                        // The predecessor went meanwhile (or was dead and
                        // we deleted it): list again.
                        Ahead::Gone => {}
                    }
                }
                Place::First { name } => {
                    let path = format!("{dir}/{name}");
                    let czxid = match found.created {
                        // Created by this try: that write is the proof.
                        Some(Some(czxid)) => czxid,
                        Some(None) => {
                            match call(left(deadline)?, s.client.check_stat(&path)).await {
                                Ok(Some(stat)) => stat.czxid,
                                Ok(None) => continue,
                                Err(e) => return Err(e.into_backend("stat")),
                            }
                        }
                        None => inner.confirm(&s, &path, &data, deadline).await?,
                    };
                    let token = token_of(czxid, node.offset)?;
                    let won = inner.with_entry(key, &ticket, |e| {
                        if e.lease != *lease || e.generation != s.generation {
                            return false;
                        }
                        e.node = Some(node.clone());
                        e.state = State::Held {
                            token,
                            expires: sent + life,
                        };
                        true
                    });
                    inner.count_queue(&inner.entries.lock().expect("entries"));
                    return Ok(match won {
                        Some(true) => Attempt::Acquired { token },
                        // A newer try of this sidecar took the node over:
                        // this lease id lost, the node is the newer one's.
                        Some(false) => Attempt::Held { remaining: None },
                        // Released meanwhile: the node is nobody's.
                        None => {
                            inner.doom(s.generation, key, ticket);
                            Attempt::Held { remaining: None }
                        }
                    });
                }
            }
        }
        Err(BackendError::Unavailable(
            "ZooKeeper lock queue kept changing; try again".into(),
        ))
    }

    async fn renew(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        ttl: Duration,
    ) -> Result<Ownership, BackendError> {
        let inner = &self.inner;
        let sent = Instant::now();
        let s = inner.sessions.current()?;
        let (path, data, ticket, token) = {
            let mut entries = inner.entries.lock().expect("entries");
            let Some(e) = entries.get(key) else {
                return Ok(Ownership::Free);
            };
            if e.generation != s.generation {
                entries.remove(key);
                return Ok(Ownership::Free);
            }
            match (&e.state, &e.node) {
                (State::Held { token, expires }, Some(node)) if e.lease == *lease => {
                    if *expires <= sent {
                        // Past its TTL: the sweeper deletes it; never revive.
                        return Ok(Ownership::Free);
                    }
                    (
                        format!(
                            "{}/{}",
                            queue::key_dir(&inner.locks_dir, key.as_str()),
                            node.name
                        ),
                        NodeData::encode(
                            node.offset,
                            lease.as_str(),
                            node_life(ttl, inner.delay_of(key.is_reader())),
                            inner.delay_of(key.is_reader()),
                        ),
                        e.ticket.clone(),
                        *token,
                    )
                }
                (State::Held { .. }, _) => return Ok(Ownership::OtherHolder),
                _ => return Ok(Ownership::Free),
            }
        };
        match call(
            inner.timeout,
            s.client.set_data(&path, data.as_bytes(), None),
        )
        .await
        {
            Ok(stat) => {
                s.saw(&stat);
            }
            // Deleted: by our sweeper past the TTL, or as dead by the
            // successor (its expiry record passed on the ensemble's clock).
            Err(Failed::Zk(zk::Error::NoNode | zk::Error::SessionExpired)) => {
                inner.forget(key, &ticket);
                return Ok(Ownership::Free);
            }
            Err(e) => return Err(e.into_backend("renew")),
        }
        // A reply that comes after the TTL ran out does not revive the
        // lease: the sweeper removed the entry (or is about to).
        let renewed = inner.with_entry(key, &ticket, |e| match &mut e.state {
            State::Held { expires, .. } if e.lease == *lease && *expires > Instant::now() => {
                *expires = sent + node_life(ttl, inner.delay_of(key.is_reader()));
                true
            }
            _ => false,
        });
        Ok(if renewed == Some(true) {
            Ownership::Owned { token }
        } else {
            Ownership::Free
        })
    }

    async fn renew_many(
        &self,
        items: &[(LockKey, LeaseId, Duration)],
    ) -> Result<Vec<Ownership>, BackendError> {
        // Requests pipeline on the session's one connection.
        let results = join_all(items.iter().map(|(k, l, t)| self.renew(k, l, *t))).await;
        results.into_iter().collect()
    }

    async fn check_many(
        &self,
        items: &[(LockKey, LeaseId)],
    ) -> Result<Vec<Ownership>, BackendError> {
        let inner = &self.inner;
        let s = inner.sessions.current()?;
        let mut out = Vec::with_capacity(items.len());
        for (key, lease) in items {
            let node = {
                let entries = inner.entries.lock().expect("entries");
                entries.get(key).and_then(|e| match (&e.state, &e.node) {
                    (State::Held { token, .. }, Some(name))
                        if e.lease == *lease && e.generation == s.generation =>
                    {
                        Some((
                            format!(
                                "{}/{}",
                                queue::key_dir(&inner.locks_dir, key.as_str()),
                                name.name
                            ),
                            *token,
                        ))
                    }
                    _ => None,
                })
            };
            let Some((path, token)) = node else {
                out.push(Ownership::Free);
                continue;
            };
            let stat = call(inner.timeout, s.client.check_stat(&path))
                .await
                .map_err(|e| e.into_backend("check"))?;
            let ours = stat.is_some_and(|st| st.ephemeral_owner == s.client.session_id().0);
            out.push(if ours {
                Ownership::Owned { token }
            } else {
                Ownership::Free
            });
        }
        Ok(out)
    }

    fn failovers(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.inner.sessions.failovers.subscribe())
    }

    async fn release(&self, key: &LockKey, lease: &LeaseId) -> Result<Ownership, BackendError> {
        let inner = &self.inner;
        let removed = {
            let mut entries = inner.entries.lock().expect("entries");
            match entries.get(key) {
                Some(e) if e.lease == *lease => entries.remove(key),
                Some(Entry {
                    state: State::Held { .. },
                    ..
                }) => return Ok(Ownership::OtherHolder),
                _ => None,
            }
        };
        let Some(entry) = removed else {
            return Ok(Ownership::Free);
        };
        inner.count_queue(&inner.entries.lock().expect("entries"));
        let held = match entry.state {
            State::Held { token, .. } => Some(token),
            State::Waiting { .. } => None,
        };
        let dir = queue::key_dir(&inner.locks_dir, key.as_str());
        if entry.holds_written {
            if let Ok(s) = inner.sessions.current() {
                if s.generation == entry.generation {
                    inner.delete_holds(&s, &dir, lease).await;
                }
            }
        }
        let deleted = match inner.sessions.current() {
            Ok(s) if s.generation == entry.generation => match &entry.node {
                Some(node) => {
                    inner
                        .delete_node(&s, &format!("{dir}/{}", node.name), inner.timeout)
                        .await
                }
                None => inner.delete_ticket(&s, &dir, &entry.ticket).await,
            },
            // The session is gone, and its nodes with it.
            _ => Ok(()),
        };
        if let Err(e) = deleted {
            // Keep trying in the background: until the node goes, the key
            // stays blocked for everyone (never the unsafe side).
            inner.metrics.cleanup_retries.inc();
            tracing::warn!(key = %key, error = %e, "release could not delete the lock node; retrying");
            inner
                .doomed
                .lock()
                .expect("doomed")
                .push((entry.generation, dir, entry.ticket));
        }
        Ok(match held {
            Some(token) => {
                inner.wake.released(key.as_str());
                Ownership::Owned { token }
            }
            None => Ownership::Free,
        })
    }

    fn held_keeps_a_place(&self) -> bool {
        !crate::mutants::active("zk_waiter_node_left")
    }

    fn supports_reentrancy(&self) -> bool {
        true
    }

    /// A reader's entry is a queue node of its own with a reader's ticket
    /// ([`queue`]): it holds when no write node is ahead of it, and its
    /// token is its node's creation zxid like a writer's.
    fn supports_read_locks(&self) -> bool {
        true
    }

    /// Only for a lease this sidecar's session holds the key with: a
    /// ZooKeeper lease lives and dies with its session, so no other
    /// sidecar can adopt it.
    async fn holds(
        &self,
        key: &LockKey,
        lease: &LeaseId,
        change: HoldsChange<'_>,
    ) -> Result<Holds, BackendError> {
        let inner = &self.inner;
        let s = inner.sessions.current()?;
        {
            let entries = inner.entries.lock().expect("entries");
            match entries.get(key) {
                Some(e)
                    if e.generation == s.generation
                        && e.lease == *lease
                        && matches!(e.state, State::Held { .. }) => {}
                Some(Entry {
                    state: State::Held { .. },
                    ..
                }) => return Ok(Holds::OtherHolder),
                _ => return Ok(Holds::Free),
            }
        }
        inner.change_holds(&s, key, lease, change).await
    }

    async fn watch(&self, _key: &LockKey, _timeout: Duration) -> WatchGuard {
        // The predecessor watch is armed by `try_acquire` itself, atomically
        // with finding the predecessor still there.
        WatchGuard::none()
    }

    async fn raise_token_floor(&self, key: &LockKey, floor: u64) -> Result<(), BackendError> {
        let inner = &self.inner;
        let s = inner.sessions.current()?;
        let t = inner.timeout;
        for _ in 0..5 {
            let (data, stat) = call(t, s.client.get_data(&inner.offset_path))
                .await
                .map_err(|e| e.into_backend("read token offset"))?;
            // Rewriting the same value tells us the newest zxid: every node
            // created later has a larger one.
            let stat2 = match call(
                t,
                s.client
                    .set_data(&inner.offset_path, &data, Some(stat.version)),
            )
            .await
            {
                Ok(st) => st,
                Err(Failed::Zk(zk::Error::BadVersion)) => continue,
                Err(e) => return Err(e.into_backend("touch token offset")),
            };
            let old: u64 = String::from_utf8_lossy(&data).trim().parse().unwrap_or(0);
            let newest = u64::try_from(stat2.mzxid).unwrap_or(0);
            let new = old.max(floor.saturating_sub(newest) + 1);
            if new == old {
                *s.offset.lock().expect("offset") = (old, stat2.version);
                return Ok(());
            }
            match call(
                t,
                s.client.set_data(
                    &inner.offset_path,
                    new.to_string().as_bytes(),
                    Some(stat2.version),
                ),
            )
            .await
            {
                Ok(st3) => {
                    tracing::warn!(key = %key, floor, old_offset = old, new_offset = new,
                        "raised the ZooKeeper token offset past a gateway mark");
                    *s.offset.lock().expect("offset") = (new, st3.version);
                    return Ok(());
                }
                Err(Failed::Zk(zk::Error::BadVersion)) => continue,
                Err(e) => return Err(e.into_backend("raise token offset")),
            }
        }
        Err(BackendError::Unavailable(
            "token offset kept changing".into(),
        ))
    }

    fn max_ttl_why(&self) -> &'static str {
        "45% of the session timeout the ZooKeeper ensemble granted, minus sidecar.lock_delay_ms: a lease must end before its session could expire"
    }

    fn max_ttl(&self) -> Option<Duration> {
        let granted = Duration::from_millis(self.inner.sessions.granted_ms.load(Ordering::Relaxed));
        if crate::mutants::active("zk_ttl_past_session") {
            return None;
        }
        Some(max_lease(granted, self.inner.lock_delay))
    }

    /// A persistent node per semaphore holding its count: the create that
    /// finds it there already (`NodeExists`, a committed write) is followed
    /// on the same session by the read, which therefore sees it.
    async fn fix_permits(&self, name: &LockKey, permits: u32) -> Result<u32, BackendError> {
        let inner = &self.inner;
        let deadline = Instant::now() + inner.timeout;
        let s = inner.sessions.current()?;
        let persistent = zk::CreateMode::Persistent.with_acls(inner.acls);
        match call(
            left(deadline)?,
            s.client.create(&inner.semaphores_dir, b"", &persistent),
        )
        .await
        {
            Ok(_) | Err(Failed::Zk(zk::Error::NodeExists)) => {}
            Err(e) => return Err(e.into_backend("create semaphores node")),
        }
        let path = queue::key_dir(&inner.semaphores_dir, name.as_str());
        let count = permits.to_string();
        match call(
            left(deadline)?,
            s.client.create(&path, count.as_bytes(), &persistent),
        )
        .await
        {
            Ok(_) => return Ok(permits),
            Err(Failed::Zk(zk::Error::NodeExists)) => {}
            Err(e) => return Err(e.into_backend("create semaphore")),
        }
        let (data, _) = call(left(deadline)?, s.client.get_data(&path))
            .await
            .map_err(|e| e.into_backend("read semaphore"))?;
        std::str::from_utf8(&data)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| BackendError::Protocol("semaphore node with a bad permit count".into()))
    }

    /// The queue's lowest node is the holder: its lease (from the node's
    /// data), its token (creation zxid + offset) and the nodes behind it.
    /// Or, when readers are ahead of every write node, their number.
    /// Its time left is not known here — it is counted on the holder's
    /// sidecar and on the leader's clock ([`expiry`]) — so none is given.
    async fn inspect(&self, key: &LockKey) -> Result<KeyView, BackendError> {
        let inner = &self.inner;
        let deadline = Instant::now() + inner.timeout;
        let s = inner.sessions.current()?;
        let dir = queue::key_dir(&inner.locks_dir, key.as_str());
        for _ in 0..QUEUE_ROUNDS {
            let mut queue: Vec<(u64, String)> =
                match call(left(deadline)?, s.client.list_children(&dir)).await {
                    Ok(children) => children
                        .into_iter()
                        .filter_map(|c| queue::sequence(&c).map(|n| (n, c)))
                        .collect(),
                    Err(Failed::Zk(zk::Error::NoNode)) => Vec::new(),
                    Err(e) => return Err(e.into_backend("list queue")),
                };
            queue.sort_unstable();
            let Some((_, first)) = queue.first() else {
                return Ok(KeyView {
                    waiting: Some(0),
                    readers: Some(0),
                    ..KeyView::default()
                });
            };
            // Readers ahead of every write node hold the key together.
            let readers = queue
                .iter()
                .take_while(|(_, c)| queue::is_read_node(c))
                .count() as u64;
            if readers > 0 {
                return Ok(KeyView {
                    waiting: Some(queue.len() as u64 - readers),
                    readers: Some(readers),
                    ..KeyView::default()
                });
            }
            let path = format!("{dir}/{first}");
            let (data, stat) = match call(left(deadline)?, s.client.get_data(&path)).await {
                Ok(found) => found,
                // Released between the two reads: look again.
                Err(Failed::Zk(zk::Error::NoNode)) => continue,
                Err(e) => return Err(e.into_backend("read node")),
            };
            let offset = NodeData::parse(&data)
                .ok_or_else(|| BackendError::Protocol(format!("{path}: no token offset")))?
                .offset;
            let lease = String::from_utf8_lossy(&data)
                .split(' ')
                .nth(1)
                .unwrap_or_default()
                .to_owned();
            return Ok(KeyView {
                holder: Some(HolderView {
                    lease,
                    token: token_of(stat.czxid, offset)?,
                    remaining: None,
                }),
                waiting: Some(queue.len() as u64 - 1),
                readers: Some(0),
                ..KeyView::default()
            });
        }
        Err(BackendError::Unavailable(
            "ZooKeeper lock queue kept changing; try again".into(),
        ))
    }

    async fn ping(&self) -> Result<(), BackendError> {
        let s = self.inner.sessions.current()?;
        call(
            self.inner.timeout,
            s.client.check_stat(&self.inner.offset_path),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.into_backend("ping"))
    }
}
