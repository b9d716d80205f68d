//! Servers started once per test binary and shared by its tests, each test
//! isolated in its own database, key prefix or ZooKeeper root (issue 29).
//!
//! Why: starting a server per test costs more than most tests take to run
//! (MariaDB's install-db about 4 s, initdb about 1.3 s, a ZooKeeper JVM
//! about 1.2 s, a Sentinel set or a Cluster several seconds), and a binary
//! such as `lock_suite` starts one per test. A test that kills, pauses or
//! reconfigures its server must still start its own; everything here is
//! for tests that only *use* a server.
//!
//! Each server starts lazily, on the first test that asks, in a `static`
//! (so it is never dropped): it is started [`detached`], and a watcher
//! process kills it and removes its directory once the test binary has
//! exited.
//!
//! On by default; `FENCER_TEST_SHARED=0` gives every test its own servers
//! again. On a loaded machine (load 15-20) the shared lock_suite ran 24%
//! faster (395 s -> 300 s) but short-TTL scenarios failed more often; once
//! those scale their times with the backend's speed, an idle machine ran
//! all 136 lock_suite tests shared, beside another test binary, in 289 s
//! (`FENCER_TEST_SHARED=1 FENCER_TEST_JOBS=2 python3 tests/run_binaries.py`).

use std::ops::Deref;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::etcd::EtcdCluster;
use super::launcher::{detached, remove_at_exit};
use super::mariadb::MariaDb;
use super::postgres::PgServer;
use super::redis_topology::{ClusterSet, SentinelOpts, SentinelSet};
use super::zookeeper::ZooKeeperEnsemble;

/// Whether tests may share servers (unless `FENCER_TEST_SHARED=0`).
pub fn enabled() -> bool {
    std::env::var("FENCER_TEST_SHARED").map_or(true, |v| v != "0")
}

/// `t<n>`: a name no other test of this binary run gets, for a database,
/// key prefix or ZooKeeper root.
pub fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!("t{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A server a test either owns (dropped with it) or borrows from the
/// binary-wide statics below.
pub enum Server<T: 'static> {
    Own(T),
    Shared(&'static T),
}

impl<T> Deref for Server<T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Server::Own(t) => t,
            Server::Shared(t) => t,
        }
    }
}

impl<T> Server<T> {
    pub fn is_shared(&self) -> bool {
        matches!(self, Server::Shared(_))
    }
}

/// The binary's PostgreSQL server (default settings of [`PgServer::start`]).
pub fn postgres() -> &'static PgServer {
    static S: OnceLock<PgServer> = OnceLock::new();
    S.get_or_init(|| detached(PgServer::start))
}

/// The binary's MariaDB server (default options of [`MariaDb::start`]).
pub fn mariadb() -> &'static MariaDb {
    static S: OnceLock<MariaDb> = OnceLock::new();
    S.get_or_init(|| detached(MariaDb::start))
}

/// The binary's standalone ZooKeeper server.
pub fn zookeeper() -> &'static ZooKeeperEnsemble {
    static S: OnceLock<ZooKeeperEnsemble> = OnceLock::new();
    S.get_or_init(|| {
        let ens = detached(|| ZooKeeperEnsemble::with_size(1));
        remove_at_exit(ens.dir());
        ens
    })
}

/// The binary's etcd cluster: three members, or
/// `FENCER_TEST_ETCD_MEMBERS` (the behavioural suite on one member:
/// `FENCER_TEST_ETCD_MEMBERS=1 cargo test --test lock_suite etcd::`).
pub fn etcd() -> &'static EtcdCluster {
    static S: OnceLock<EtcdCluster> = OnceLock::new();
    S.get_or_init(|| detached(|| EtcdCluster::with_size(etcd_members())))
}

/// Members of the etcd clusters the behavioural suite starts.
pub fn etcd_members() -> usize {
    std::env::var("FENCER_TEST_ETCD_MEMBERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|n| (1..=7).contains(n))
        .unwrap_or(3)
}

/// The binary's Sentinel set ([`SentinelOpts::default`]: a master, two
/// replicas, three sentinels).
pub fn sentinel() -> &'static SentinelSet {
    static S: OnceLock<SentinelSet> = OnceLock::new();
    S.get_or_init(|| detached(|| SentinelSet::start(SentinelOpts::default())))
}

/// The binary's Redis Cluster: three masters with a replica each.
pub fn cluster() -> &'static ClusterSet {
    static S: OnceLock<ClusterSet> = OnceLock::new();
    S.get_or_init(|| detached(|| ClusterSet::start(3, 1)))
}

/// A PostgreSQL database of one test: a fresh database on the shared
/// server, or the `postgres` database of a server the test owns.
pub struct PgDb {
    pub server: Server<PgServer>,
    url: String,
}

impl PgDb {
    /// A fresh database on the binary's shared server.
    pub fn shared() -> PgDb {
        let server = postgres();
        let name = unique_name();
        let out = Command::new("psql")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres"])
            .args(["-p", &server.port.to_string(), "-v", "ON_ERROR_STOP=1"])
            .arg("-c")
            .arg(format!("CREATE DATABASE {name}"))
            .env_remove("PGSERVICE")
            .stdin(Stdio::null())
            .output()
            .expect("psql must be installed (apt-get install postgresql-client)");
        assert!(
            out.status.success(),
            "CREATE DATABASE {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PgDb {
            url: format!("postgres://postgres@127.0.0.1:{}/{name}", server.port),
            server: Server::Shared(server),
        }
    }

    pub fn own(server: PgServer) -> PgDb {
        PgDb {
            url: server.url(),
            server: Server::Own(server),
        }
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }
}

/// A MariaDB database of one test: a fresh database on the shared server,
/// or the `fencer` database of a server the test owns.
pub struct MyDb {
    pub server: Server<MariaDb>,
    url: String,
}

impl MyDb {
    /// A fresh database on the binary's shared server.
    pub fn shared() -> MyDb {
        let server = mariadb();
        let name = unique_name();
        server.sql(&format!("CREATE DATABASE {name}"));
        MyDb {
            url: format!("mysql://root@127.0.0.1:{}/{name}", server.port),
            server: Server::Shared(server),
        }
    }

    pub fn own(server: MariaDb) -> MyDb {
        MyDb {
            url: server.url(),
            server: Server::Own(server),
        }
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }
}
