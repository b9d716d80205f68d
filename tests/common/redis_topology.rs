//! Redis topologies a test starts and owns: a Sentinel set (master,
//! replicas, sentinels) and a Redis Cluster.
//!
//! Why: failover is where a lock service loses safety (an acknowledged lock
//! write that never reached the replica a sentinel or the cluster promotes),
//! so tests need real failovers they can trigger and time: kill or pause a
//! node, freeze replication, wait for the new master. Every process runs on
//! free loopback ports in its own temp dir (never the machine's Redis), and
//! everything a set started is killed when it is dropped, even after a
//! panic.
//!
//! Waits are bounded and panic with the tail of every process log, so a
//! failing test says what Redis was doing.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::free_port;
use super::launcher::{tail, ServerProcess};

const HOST: &str = "127.0.0.1";
/// How long a topology may take to come up before the test panics.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect/read timeout of the harness's own probes: short, so a paused
/// node costs a probe loop little.
const PROBE_TIMEOUT: Duration = Duration::from_millis(700);

// ---------------------------------------------------------------- processes

/// One `redis-server` process (data node or sentinel) in its own temp dir.
/// Its port and directory survive a kill, so a restart is the same node.
struct Proc {
    what: String,
    port: u16,
    argv: Vec<String>,
    // Declared before `dir`: the process dies before its directory goes.
    proc: ServerProcess,
    dir: tempfile::TempDir,
}

impl Proc {
    /// Starts a process on a free port; `make(port, dir)` gives its
    /// arguments. A port checked free can be taken by another test before
    /// Redis binds it, so "address in use" means: try other ports.
    fn start(what: &str, make: &mut dyn FnMut(u16, &Path) -> Vec<String>) -> Proc {
        let mut last = String::new();
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("fencer-redis-")
                .tempdir()
                .unwrap();
            let port = free_port();
            let argv = make(port, dir.path());
            let mut p = Proc {
                what: what.to_owned(),
                port,
                argv,
                proc: ServerProcess::new(
                    format!("{what} on port {port}"),
                    dir.path().join("stderr.log"),
                ),
                dir,
            };
            match p.spawn() {
                Ok(()) => return p,
                Err(e) if e.contains("Address already in use") => last = e,
                Err(e) => panic!("{e}"),
            }
        }
        panic!("{what}: no free port after 5 attempts: {last}");
    }

    /// Spawns with the current `argv` and waits until it answers PING.
    /// The error carries both logs (`redis.log` is where Redis says
    /// "Address already in use").
    fn spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new("redis-server");
        cmd.args(&self.argv);
        let port = self.port;
        self.proc
            .start(
                cmd,
                Duration::from_secs(15),
                Duration::from_millis(20),
                || query::<String>(port, &redis::cmd("PING")).is_ok(),
            )
            .map_err(|e| format!("{e}\n{}", self.log_tail(30)))
    }

    fn respawn(&mut self) {
        assert!(
            !self.alive(),
            "{} on port {} is running: kill it first",
            self.what,
            self.port
        );
        if let Err(e) = self.spawn() {
            panic!("restarting: {e}");
        }
    }

    /// Spawned and not killed by us.
    fn alive(&self) -> bool {
        self.proc.running()
    }

    /// Alive and not paused: worth asking.
    fn answering(&self) -> bool {
        self.alive() && !self.proc.paused()
    }

    /// SIGKILL (after SIGCONT, so a paused process dies too).
    fn kill(&mut self) {
        self.proc.kill();
    }

    fn pause(&self) {
        assert!(self.alive(), "pausing a dead node");
        self.proc.pause();
    }

    fn resume(&self) {
        self.proc.resume();
    }

    fn log_tail(&self, lines: usize) -> String {
        let mut out = String::new();
        for name in ["redis.log", "stderr.log"] {
            let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            out.push_str(&tail(&text, lines));
        }
        out
    }

    fn log_section(&self) -> String {
        let state = match (self.alive(), self.proc.paused()) {
            (false, _) => "dead",
            (true, true) => "paused",
            (true, false) => "running",
        };
        format!(
            "==== {} 127.0.0.1:{} ({state}) ====\n{}",
            self.what,
            self.port,
            self.log_tail(40)
        )
    }
}

fn data_node_args(port: u16, dir: &Path) -> Vec<String> {
    vec![
        "--port".into(),
        port.to_string(),
        "--bind".into(),
        HOST.into(),
        "--save".into(),
        "".into(),
        "--appendonly".into(),
        "no".into(),
        "--dir".into(),
        dir.display().to_string(),
        "--logfile".into(),
        dir.join("redis.log").display().to_string(),
        "--repl-diskless-sync".into(),
        "yes".into(),
        "--repl-diskless-sync-delay".into(),
        "0".into(),
        "--replica-announce-ip".into(),
        HOST.into(),
    ]
}

// ---------------------------------------------------------------- probes

/// A fresh connection with short timeouts, for the harness's own probes.
fn probe_conn(port: u16) -> redis::RedisResult<redis::Connection> {
    let c = redis::Client::open(format!("redis://{HOST}:{port}"))?
        .get_connection_with_timeout(PROBE_TIMEOUT)?;
    c.set_read_timeout(Some(PROBE_TIMEOUT))?;
    c.set_write_timeout(Some(PROBE_TIMEOUT))?;
    Ok(c)
}

fn query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> redis::RedisResult<T> {
    cmd.query(&mut probe_conn(port)?)
}

fn connect(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://{HOST}:{port}/0"))
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("connecting to 127.0.0.1:{port}: {e}"))
}

/// The first element of `ROLE`: "master", "slave" or "sentinel".
fn role(port: u16) -> Option<String> {
    match query::<redis::Value>(port, &redis::cmd("ROLE")).ok()? {
        redis::Value::Array(v) => match v.first()? {
            redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            redis::Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        },
        _ => None,
    }
}

/// `field:value` from an INFO text.
fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

fn info(port: u16, section: &str) -> Option<String> {
    query::<String>(port, redis::cmd("INFO").arg(section)).ok()
}

/// Polls `f` every 100 ms until it is true; on timeout panics with `logs()`.
fn wait_for(what: &str, timeout: Duration, logs: &dyn Fn() -> String, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    loop {
        if f() {
            return;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}\n{}", logs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn toml_array(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("\"{s}\"")).collect();
    format!("[{}]", quoted.join(","))
}

// ---------------------------------------------------------------- relay

/// A loopback relay in front of the original master that can freeze the
/// replication connections only (those that sent REPLCONF/PSYNC/SYNC),
/// holding the bytes with the sockets open, while sentinel and client
/// connections through it go on.
///
/// Why not one `TcpFault` per replica: a sentinel compares each replica's
/// `master_host:master_port` with the master address it monitors, and after
/// `failover-timeout` it "fixes" a replica that points elsewhere (a relay)
/// with `REPLICAOF <master>` (`+fix-slave-config`), which silently bypasses
/// the relay. So the address the sentinels monitor must be the relay itself,
/// and the relay must freeze replication without freezing the sentinels
/// (which would make them fail the master over).
struct ReplRelay {
    port: u16,
    shared: Arc<RelayShared>,
}

struct RelayShared {
    upstream: AtomicU16,
    frozen: AtomicBool,
    stop: AtomicBool,
    conns: Mutex<Vec<(TcpStream, TcpStream)>>,
}

impl ReplRelay {
    /// Listens now (so its port can go into the nodes' arguments); forwards
    /// once `set_upstream` has been called.
    fn bind() -> ReplRelay {
        let listener = TcpListener::bind((HOST, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(RelayShared {
            upstream: AtomicU16::new(0),
            frozen: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if sh.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let upstream = sh.upstream.load(Ordering::SeqCst);
                let server = match TcpStream::connect((HOST, upstream)) {
                    Ok(s) if upstream != 0 => s,
                    _ => {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    }
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                sh.conns
                    .lock()
                    .unwrap()
                    .push((client.try_clone().unwrap(), server.try_clone().unwrap()));
                let replication = Arc::new(AtomicBool::new(false));
                for up in [true, false] {
                    let (from, to) = if up {
                        (client.try_clone().unwrap(), server.try_clone().unwrap())
                    } else {
                        (server.try_clone().unwrap(), client.try_clone().unwrap())
                    };
                    let (sh, replication) = (sh.clone(), replication.clone());
                    std::thread::spawn(move || relay_pump(sh, replication, from, to, up));
                }
            }
        });
        ReplRelay { port, shared }
    }

    fn set_upstream(&self, port: u16) {
        self.shared.upstream.store(port, Ordering::SeqCst);
    }

    fn freeze(&self, on: bool) {
        self.shared.frozen.store(on, Ordering::SeqCst);
    }
}

impl Drop for ReplRelay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.frozen.store(false, Ordering::SeqCst);
        for (c, s) in self.shared.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
            let _ = s.shutdown(Shutdown::Both);
        }
        let _ = TcpStream::connect((HOST, self.port));
    }
}

fn relay_pump(
    sh: Arc<RelayShared>,
    replication: Arc<AtomicBool>,
    mut from: TcpStream,
    mut to: TcpStream,
    up: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut seen = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        // The replica's handshake opens the connection; later bytes are
        // data, so look only at the first few KiB.
        if up && seen < 4096 {
            let upper = chunk.to_ascii_uppercase();
            if [&b"\r\nREPLCONF\r\n"[..], b"\r\nPSYNC\r\n", b"\r\nSYNC\r\n"]
                .iter()
                .any(|pat| upper.windows(pat.len()).any(|w| w == *pat))
            {
                replication.store(true, Ordering::SeqCst);
            }
        }
        seen += n;
        while sh.frozen.load(Ordering::SeqCst)
            && replication.load(Ordering::SeqCst)
            && !sh.stop.load(Ordering::SeqCst)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        if to.write_all(chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

// ---------------------------------------------------------------- sentinel

/// Options of a [`SentinelSet`].
#[derive(Clone, Debug)]
pub struct SentinelOpts {
    /// Replicas of the master (default 2).
    pub replicas: usize,
    /// Sentinels (default 3); the quorum is `sentinels / 2 + 1`.
    pub sentinels: usize,
    /// `sentinel down-after-milliseconds` (default 1000): short, so a
    /// failover takes seconds.
    pub down_after_ms: u64,
    /// `sentinel failover-timeout` (default 5000).
    pub failover_timeout_ms: u64,
    /// Replication goes through a relay the test can freeze (the "lossy
    /// failover" recipe: freeze, write to the master, kill it, and the
    /// promoted replica never got the write). Default false.
    ///
    /// Why one relay in front of the master rather than one per replica:
    /// the sentinels would re-point a replica that replicates from anything
    /// but the address they monitor straight at the master after
    /// `failover_timeout_ms` (`+fix-slave-config`). So there is one relay in
    /// front of the original master, which the sentinels monitor and the
    /// replicas replicate from, and which freezes only replication
    /// connections. The master announces the relay's port
    /// (`replica-announce-port`) so it keeps one address if it rejoins as a
    /// replica. The API still speaks of nodes' own ports: a sentinel's answer
    /// naming the relay is translated. After a failover the sentinels point
    /// replicas at the new master directly, and the relay no longer matters.
    pub relay_replication: bool,
    /// Extra arguments for the data nodes (master and replicas), e.g.
    /// `["--min-replicas-to-write", "1"]`.
    pub node_args: Vec<String>,
}

impl Default for SentinelOpts {
    fn default() -> Self {
        SentinelOpts {
            replicas: 2,
            sentinels: 3,
            down_after_ms: 1000,
            failover_timeout_ms: 5000,
            relay_replication: false,
            node_args: Vec::new(),
        }
    }
}

/// A master, its replicas and the sentinels monitoring it, all started and
/// owned by the test (SIGCONT + SIGKILL on drop).
pub struct SentinelSet {
    name: String,
    opts: SentinelOpts,
    /// `nodes[0]` is the original master; the rest its replicas.
    nodes: Vec<Proc>,
    sentinels: Vec<Proc>,
    relay: Option<ReplRelay>,
}

impl SentinelSet {
    /// Starts the data nodes, waits until every replica's link is up, then
    /// the sentinels, and returns when every sentinel reports the master,
    /// sees every replica with a working link and sees the other sentinels.
    /// Panics with every log after 30 s.
    pub fn start(opts: SentinelOpts) -> SentinelSet {
        assert!(opts.sentinels >= 1, "a sentinel set needs a sentinel");
        let started = Instant::now();
        let relay = opts.relay_replication.then(ReplRelay::bind);
        let relay_port = relay.as_ref().map(|r| r.port);
        let node_args = opts.node_args.clone();
        let master = Proc::start("data node (started as master)", &mut |port, dir| {
            let mut a = data_node_args(port, dir);
            if let Some(rp) = relay_port {
                a.extend(["--replica-announce-port".into(), rp.to_string()]);
            }
            a.extend(node_args.iter().cloned());
            a
        });
        if let Some(r) = &relay {
            r.set_upstream(master.port);
        }
        let visible_master = relay_port.unwrap_or(master.port);
        let mut set = SentinelSet {
            name: "fencer-test".to_owned(),
            opts: opts.clone(),
            nodes: vec![master],
            sentinels: Vec::new(),
            relay,
        };
        for i in 0..opts.replicas {
            let replica = Proc::start(
                &format!("data node (started as replica {i})"),
                &mut |port, dir| {
                    let mut a = data_node_args(port, dir);
                    a.extend(node_args.iter().cloned());
                    a.extend([
                        "--replicaof".into(),
                        HOST.into(),
                        visible_master.to_string(),
                    ]);
                    a
                },
            );
            set.nodes.push(replica);
        }
        let replica_ports: Vec<u16> = set.nodes[1..].iter().map(|n| n.port).collect();
        wait_for(
            "replicas' master_link_status:up",
            START_TIMEOUT.saturating_sub(started.elapsed()),
            &|| set.logs(),
            || {
                replica_ports.iter().all(|&p| {
                    info(p, "replication")
                        .and_then(|i| info_field(&i, "master_link_status"))
                        .is_some_and(|s| s == "up")
                })
            },
        );
        let quorum = opts.sentinels / 2 + 1;
        for i in 0..opts.sentinels {
            let name = set.name.clone();
            let o = &opts;
            let sentinel = Proc::start(&format!("sentinel {i}"), &mut |port, dir| {
                let conf = dir.join("sentinel.conf");
                let text = format!(
                    "port {port}\n\
                     bind {HOST}\n\
                     protected-mode no\n\
                     daemonize no\n\
                     dir {dir}\n\
                     logfile {log}\n\
                     sentinel monitor {name} {HOST} {visible_master} {quorum}\n\
                     sentinel down-after-milliseconds {name} {down}\n\
                     sentinel failover-timeout {name} {fo}\n\
                     sentinel parallel-syncs {name} 1\n",
                    dir = dir.display(),
                    log = dir.join("redis.log").display(),
                    down = o.down_after_ms,
                    fo = o.failover_timeout_ms,
                );
                std::fs::write(&conf, text).unwrap();
                vec![conf.display().to_string(), "--sentinel".into()]
            });
            set.sentinels.push(sentinel);
        }
        let remaining = START_TIMEOUT.saturating_sub(started.elapsed());
        let want_replicas: HashSet<u16> = replica_ports.iter().copied().collect();
        wait_for(
            "every sentinel to see the master, every replica and the other sentinels",
            remaining,
            &|| set.logs(),
            || {
                set.sentinels
                    .iter()
                    .all(|s| set.sentinel_ready(s.port, visible_master, &want_replicas))
            },
        );
        set
    }

    fn sentinel_ready(&self, port: u16, master: u16, replicas: &HashSet<u16>) -> bool {
        let Some(addr) = self.sentinel_master_addr(port) else {
            return false;
        };
        if addr != master {
            return false;
        }
        let Ok(m) =
            query::<Vec<String>>(port, redis::cmd("SENTINEL").arg("MASTER").arg(&self.name))
        else {
            return false;
        };
        if field(&m, "flags") != Some("master") {
            return false;
        }
        let Ok(reps) =
            query::<Vec<Vec<String>>>(port, redis::cmd("SENTINEL").arg("REPLICAS").arg(&self.name))
        else {
            return false;
        };
        let ok: HashSet<u16> = reps
            .iter()
            .filter(|r| {
                field(r, "flags") == Some("slave") && field(r, "master-link-status") == Some("ok")
            })
            .filter_map(|r| field(r, "port")?.parse().ok())
            .collect();
        if &ok != replicas {
            return false;
        }
        let Ok(others) = query::<Vec<Vec<String>>>(
            port,
            redis::cmd("SENTINEL").arg("SENTINELS").arg(&self.name),
        ) else {
            return false;
        };
        others
            .iter()
            .filter(|s| field(s, "flags") == Some("sentinel"))
            .count()
            == self.sentinels.len() - 1
    }

    /// The master port one sentinel reports, as the sentinel sees it (the
    /// relay's port while the original master is master in relay mode).
    fn sentinel_master_addr(&self, sentinel: u16) -> Option<u16> {
        let addr: Option<Vec<String>> = query(
            sentinel,
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.name),
        )
        .ok()?;
        addr?.get(1)?.parse().ok()
    }

    /// A sentinel-visible port as the node's own port.
    fn real_port(&self, port: u16) -> u16 {
        match &self.relay {
            Some(r) if r.port == port => self.nodes[0].port,
            _ => port,
        }
    }

    /// A node's own port as the sentinels know it.
    fn visible_port(&self, port: u16) -> u16 {
        match &self.relay {
            Some(r) if port == self.nodes[0].port => r.port,
            _ => port,
        }
    }

    /// The current master per the sentinels, as a node port: of the
    /// masters the answering sentinels name, the first that is running and
    /// says ROLE master (right after a failover some sentinels still name
    /// the old one); else the first named; `None` if no sentinel answers.
    fn current_master(&self) -> Option<u16> {
        let named: Vec<u16> = self
            .sentinels
            .iter()
            .filter(|s| s.answering())
            .filter_map(|s| self.sentinel_master_addr(s.port))
            .map(|p| self.real_port(p))
            .collect();
        named
            .iter()
            .copied()
            .find(|&p| self.is_running_master(p))
            .or(named.first().copied())
    }

    /// A running (not paused) data node of this set that says ROLE master.
    fn is_running_master(&self, port: u16) -> bool {
        self.nodes.iter().any(|n| n.port == port && n.answering())
            && role(port).as_deref() == Some("master")
    }

    fn node(&self, port: u16) -> &Proc {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }

    fn node_mut(&mut self, port: u16) -> &mut Proc {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }

    /// The name the sentinels monitor the master under.
    pub fn master_name(&self) -> &str {
        &self.name
    }

    /// `["127.0.0.1:PORT", ...]`, one per sentinel.
    pub fn sentinel_addrs(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("{HOST}:{}", s.port))
            .collect()
    }

    /// The sentinel addresses as a TOML array literal, for a fencer config.
    pub fn sentinels_toml(&self) -> String {
        toml_array(&self.sentinel_addrs())
    }

    /// The master's port as the sentinels report it (`GET-MASTER-ADDR-BY-NAME`
    /// on each; waits up to 5 s for one to answer). When they disagree (just
    /// after a failover) the one that is running and says ROLE master wins.
    /// In relay mode the relay's port is translated to the original
    /// master's own port.
    pub fn master_port(&self) -> u16 {
        let start = Instant::now();
        loop {
            if let Some(p) = self.current_master() {
                return p;
            }
            if start.elapsed() > Duration::from_secs(5) {
                panic!("no sentinel reports a master\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every data node's own port (master and replicas, dead or alive).
    pub fn node_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The relay's port in relay mode (the address the sentinels monitor
    /// while the original master is master).
    pub fn relay_port(&self) -> Option<u16> {
        self.relay.as_ref().map(|r| r.port)
    }

    /// A direct connection to a data node (5 s connect timeout).
    pub fn node_conn(&self, port: u16) -> redis::Connection {
        self.node(port);
        connect(port)
    }

    /// SIGKILLs the node that is master now (per the sentinels) and returns
    /// its port. The node stays dead until `restart_node`.
    pub fn kill_master(&mut self) -> u16 {
        let port = self.master_port();
        self.node_mut(port).kill();
        port
    }

    /// SIGKILLs any data node; it stays dead until `restart_node`.
    pub fn kill_node(&mut self, port: u16) {
        self.node_mut(port).kill();
    }

    /// Starts a killed node again on the same port and directory (empty:
    /// persistence is off). If a sentinel names another node that is
    /// running and says ROLE master, the node starts as its replica (right
    /// after a failover some sentinels still name the old master: every
    /// sentinel is asked); otherwise with its previous arguments. The
    /// sentinels reconfigure it if needed (their reconfiguration ends with
    /// `CLIENT KILL TYPE normal`, so connections to it may be cut).
    pub fn restart_node(&mut self, port: u16) {
        let master = self
            .sentinels
            .iter()
            .filter(|s| s.answering())
            .filter_map(|s| self.sentinel_master_addr(s.port))
            .map(|p| self.real_port(p))
            .find(|&m| m != port && self.is_running_master(m));
        let visible = master.map(|m| self.visible_port(m));
        let node = self.node_mut(port);
        if let Some(v) = visible {
            if let Some(i) = node.argv.iter().position(|a| a == "--replicaof") {
                node.argv.drain(i..i + 3);
            }
            node.argv
                .extend(["--replicaof".into(), HOST.into(), v.to_string()]);
        }
        node.respawn();
    }

    /// SIGSTOP a data node (a hung process: sockets stay open).
    pub fn pause_node(&self, port: u16) {
        self.node(port).pause();
    }

    /// SIGCONT a paused data node.
    pub fn resume_node(&self, port: u16) {
        self.node(port).resume();
    }

    /// Waits until a sentinel reports a master other than `old_port` and
    /// that node says ROLE master; returns its port. Panics with every log
    /// on timeout.
    pub fn wait_new_master(&self, old_port: u16, timeout: Duration) -> u16 {
        let start = Instant::now();
        loop {
            for s in self.sentinels.iter().filter(|s| s.answering()) {
                let Some(p) = self.sentinel_master_addr(s.port).map(|p| self.real_port(p)) else {
                    continue;
                };
                if p != old_port && self.is_running_master(p) {
                    return p;
                }
            }
            if start.elapsed() > timeout {
                panic!(
                    "no new master (other than {old_port}) after {timeout:?}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops replication from the original master (bytes held, sockets
    /// open). Only with `relay_replication`.
    pub fn freeze_replication(&self) {
        self.relay
            .as_ref()
            .expect("freeze_replication needs SentinelOpts::relay_replication")
            .freeze(true);
    }

    /// Lets held replication bytes flow again.
    pub fn thaw_replication(&self) {
        self.relay
            .as_ref()
            .expect("thaw_replication needs SentinelOpts::relay_replication")
            .freeze(false);
    }

    /// Waits until the failover business is over: every answering sentinel
    /// names the same master, flags it plain `master` (no failover in
    /// progress, not down), and that node is running and says ROLE master.
    /// Returns its port. Panics with every log on timeout.
    pub fn wait_settled(&self, timeout: Duration) -> u16 {
        let mut master = 0;
        wait_for(
            "the sentinels to agree on a master",
            timeout,
            &|| self.logs(),
            || {
                let mut named = HashSet::new();
                for s in self.sentinels.iter().filter(|s| s.answering()) {
                    let Some(p) = self.sentinel_master_addr(s.port) else {
                        return false;
                    };
                    let flags = query::<Vec<String>>(
                        s.port,
                        redis::cmd("SENTINEL").arg("MASTER").arg(&self.name),
                    );
                    if !flags.is_ok_and(|m| field(&m, "flags") == Some("master")) {
                        return false;
                    }
                    named.insert(self.real_port(p));
                }
                match named.iter().next() {
                    Some(&p) if named.len() == 1 && self.is_running_master(p) => {
                        master = p;
                        true
                    }
                    _ => false,
                }
            },
        );
        master
    }

    /// A manual failover: once the sentinels are settled (see
    /// `wait_settled`; a sentinel that has not yet heard of the previous
    /// failover would fail over the old master), `SENTINEL FAILOVER <name>`
    /// on the first sentinel that accepts it, retrying INPROG/NOGOODSLAVE
    /// refusals for up to 15 s. Returns once accepted: wait for its effect
    /// with `wait_new_master`.
    pub fn failover(&self) {
        let start = Instant::now();
        let timeout = Duration::from_secs(15);
        loop {
            self.wait_settled(timeout.saturating_sub(start.elapsed()));
            let mut errors = Vec::new();
            for s in self.sentinels.iter().filter(|s| s.answering()) {
                match query::<String>(
                    s.port,
                    redis::cmd("SENTINEL").arg("FAILOVER").arg(&self.name),
                ) {
                    Ok(_) => return,
                    Err(e) => errors.push(format!("{}: {e}", s.port)),
                }
            }
            if start.elapsed() > timeout {
                panic!("SENTINEL FAILOVER refused: {errors:?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The tail of every process log, for panic messages.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .chain(&self.sentinels)
            .map(Proc::log_section)
            .collect()
    }

    /// The options the set was started with.
    pub fn opts(&self) -> &SentinelOpts {
        &self.opts
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        // Sentinels first, so none reconfigures what is being torn down.
        for p in self.sentinels.iter_mut().chain(self.nodes.iter_mut()) {
            p.kill();
        }
    }
}

/// A value from a flat `[k1, v1, k2, v2, ...]` SENTINEL reply.
fn field<'a>(pairs: &'a [String], key: &str) -> Option<&'a str> {
    pairs
        .chunks(2)
        .find(|kv| kv.len() == 2 && kv[0] == key)
        .map(|kv| kv[1].as_str())
}

// ---------------------------------------------------------------- cluster

/// A Redis Cluster (by default 3 masters + 3 replicas) with a 1 s node
/// timeout, so a killed master's replica takes over within seconds.
pub struct ClusterSet {
    nodes: Vec<Proc>,
    masters: usize,
    replicas_per_master: usize,
    create_log: String,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug)]
struct NodeLine {
    id: String,
    port: u16,
    flags: Vec<String>,
    master_id: String,
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    fn failing(&self) -> bool {
        self.has("fail") || self.has("fail?") || self.has("handshake") || self.has("noaddr")
    }
}

fn cluster_nodes(port: u16) -> Option<Vec<NodeLine>> {
    let text = query::<String>(port, redis::cmd("CLUSTER").arg("NODES")).ok()?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 {
            return None;
        }
        let addr = f[1].split('@').next()?;
        let port = addr.rsplit(':').next()?.parse().ok()?;
        let slots = f[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => {
                    let n = s.parse().ok()?;
                    Some((n, n))
                }
            })
            .collect();
        out.push(NodeLine {
            id: f[0].to_owned(),
            port,
            flags: f[2].split(',').map(str::to_owned).collect(),
            master_id: f[3].to_owned(),
            slots,
        });
    }
    Some(out)
}

fn cluster_state_ok(port: u16) -> bool {
    query::<String>(port, redis::cmd("CLUSTER").arg("INFO"))
        .ok()
        .and_then(|i| info_field(&i, "cluster_state"))
        .is_some_and(|s| s == "ok")
}

/// The master owning `slot` in one node's view, preferring a non-failing
/// one.
fn slot_owner(view: &[NodeLine], slot: u16) -> Option<&NodeLine> {
    let owners: Vec<&NodeLine> = view
        .iter()
        .filter(|n| n.has("master") && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
        .collect();
    owners
        .iter()
        .find(|n| !n.failing())
        .or(owners.first())
        .copied()
}

impl ClusterSet {
    /// Starts `masters * (1 + replicas_per_master)` nodes and joins them
    /// with `redis-cli --cluster create`; returns when every node says
    /// `cluster_state:ok`, sees every node healthy and every replica's link
    /// is up. Panics with every log after 30 s.
    pub fn start(masters: usize, replicas_per_master: usize) -> ClusterSet {
        assert!(masters >= 3, "redis-cli --cluster create needs 3 masters");
        let total = masters * (1 + replicas_per_master);
        let mut nodes = Vec::with_capacity(total);
        for i in 0..total {
            nodes.push(Proc::start(
                &format!("cluster node {i}"),
                &mut |port, dir| {
                    let mut a = data_node_args(port, dir);
                    a.extend([
                        "--cluster-enabled".into(),
                        "yes".into(),
                        "--cluster-node-timeout".into(),
                        "1000".into(),
                        "--cluster-config-file".into(),
                        dir.join("nodes.conf").display().to_string(),
                        // The bus port is port + 10000 unless set: pick a
                        // free one, since port + 10000 may be taken.
                        "--cluster-port".into(),
                        free_port().to_string(),
                        "--cluster-announce-ip".into(),
                        HOST.into(),
                    ]);
                    a
                },
            ));
        }
        let mut set = ClusterSet {
            nodes,
            masters,
            replicas_per_master,
            create_log: String::new(),
        };
        let started = Instant::now();
        let mut cmd = Command::new("redis-cli");
        cmd.arg("--cluster").arg("create");
        for n in &set.nodes {
            cmd.arg(format!("{HOST}:{}", n.port));
        }
        cmd.args([
            "--cluster-replicas",
            &replicas_per_master.to_string(),
            "--cluster-yes",
        ]);
        let out_path = set.nodes[0].dir.path().join("cluster-create.log");
        let out = std::fs::File::create(&out_path).unwrap();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("redis-cli must be installed");
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > START_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                set.create_log = std::fs::read_to_string(&out_path).unwrap_or_default();
                panic!("redis-cli --cluster create hangs\n{}", set.logs());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        set.create_log = std::fs::read_to_string(&out_path).unwrap_or_default();
        assert!(
            status.success(),
            "redis-cli --cluster create failed ({status})\n{}",
            set.logs()
        );
        set.wait_ok(START_TIMEOUT.saturating_sub(started.elapsed()));
        set
    }

    /// Waits until every live node says `cluster_state:ok`, sees every
    /// live node without a failure flag, the expected number of masters
    /// serving slots and of replicas, and every live replica's link is up.
    /// Useful after `restart_node`. Panics with every log on timeout.
    pub fn wait_ok(&self, timeout: Duration) {
        let live: HashSet<u16> = self
            .nodes
            .iter()
            .filter(|n| n.alive())
            .map(|n| n.port)
            .collect();
        let all_alive = live.len() == self.nodes.len();
        wait_for("a healthy cluster", timeout, &|| self.logs(), || {
            self.nodes.iter().filter(|n| n.answering()).all(|n| {
                if !cluster_state_ok(n.port) {
                    return false;
                }
                let Some(view) = cluster_nodes(n.port) else {
                    return false;
                };
                let healthy = view
                    .iter()
                    .filter(|l| live.contains(&l.port))
                    .all(|l| !l.failing());
                let serving = view
                    .iter()
                    .filter(|l| l.has("master") && !l.slots.is_empty())
                    .count();
                let replicas = view.iter().filter(|l| l.has("slave")).count();
                let me_ok = match view.iter().find(|l| l.has("myself")) {
                    Some(me) if me.has("slave") => info(n.port, "replication")
                        .and_then(|i| info_field(&i, "master_link_status"))
                        .is_some_and(|s| s == "up"),
                    Some(_) => true,
                    None => false,
                };
                // With every node alive the shape must be exactly the
                // one asked for; after a failover with the old master
                // still dead, a master has fewer replicas.
                let shape = !all_alive
                    || (serving == self.masters
                        && replicas == self.masters * self.replicas_per_master);
                healthy && serving == self.masters && me_ok && shape
            })
        });
    }

    /// `["redis://127.0.0.1:PORT", ...]`, every node.
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://{HOST}:{}", n.port))
            .collect()
    }

    /// The node URLs as a TOML array literal, for a fencer config.
    pub fn nodes_toml(&self) -> String {
        toml_array(&self.node_urls())
    }

    /// Every node's port.
    pub fn node_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The port of the master serving `slot`, in the view of the first live
    /// node that answers `CLUSTER NODES` (waits up to 5 s).
    pub fn master_port_for_slot(&self, slot: u16) -> u16 {
        let start = Instant::now();
        loop {
            for n in self.nodes.iter().filter(|n| n.answering()) {
                if let Some(view) = cluster_nodes(n.port) {
                    if let Some(owner) = slot_owner(&view, slot) {
                        return owner.port;
                    }
                }
            }
            if start.elapsed() > Duration::from_secs(5) {
                panic!(
                    "no live node names a master for slot {slot}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The Redis Cluster hash slot of `key`: CRC16-XMODEM of the key, or of
    /// the content of its first `{...}` when that is non-empty, mod 16384.
    pub fn slot_of(key: &str) -> u16 {
        // fencer's own computation: the self-test checks it against
        // `CLUSTER KEYSLOT`.
        fencer::lock::redis::cluster::slot(key)
    }

    /// SIGKILL; the node stays dead until `restart_node`.
    pub fn kill_node(&mut self, port: u16) {
        self.node_mut(port).kill();
    }

    /// Starts a killed node again on the same ports and directory; its
    /// `nodes.conf` makes it the same cluster node, and it rejoins (a former
    /// master comes back as a replica of its successor). Its data is gone.
    pub fn restart_node(&mut self, port: u16) {
        self.node_mut(port).respawn();
    }

    /// SIGSTOP a node.
    pub fn pause_node(&self, port: u16) {
        self.node(port).pause();
    }

    /// SIGCONT a paused node.
    pub fn resume_node(&self, port: u16) {
        self.node(port).resume();
    }

    /// Waits until a live node names a master other than `old_port` for
    /// `slot` and says `cluster_state:ok`; returns that master's port.
    /// Panics with every log on timeout.
    pub fn wait_slot_master_change(&self, slot: u16, old_port: u16, timeout: Duration) -> u16 {
        let start = Instant::now();
        loop {
            for n in self.nodes.iter().filter(|n| n.answering()) {
                let Some(view) = cluster_nodes(n.port) else {
                    continue;
                };
                let Some(owner) = slot_owner(&view, slot) else {
                    continue;
                };
                if owner.port != old_port && !owner.failing() && cluster_state_ok(n.port) {
                    return owner.port;
                }
            }
            if start.elapsed() > timeout {
                panic!(
                    "slot {slot} still on {old_port} (or cluster not ok) after {timeout:?}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Moves `slot` from node `from` to node `to` the way `redis-cli
    /// --cluster reshard` does: IMPORTING/MIGRATING, `MIGRATE` key by key
    /// (clients meet `ASK` meanwhile), then `SETSLOT NODE` on the target,
    /// the source and every other node (clients meet `MOVED`; the source
    /// drops its sharded subscriptions of the slot with `sunsubscribe`).
    pub fn migrate_slot(&self, slot: u16, from: u16, to: u16) {
        let (from_id, to_id) = (self.node_id(from).unwrap(), self.node_id(to).unwrap());
        let mut src = self.conn(from);
        let mut dst = self.conn(to);
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&from_id)
            .query(&mut dst)
            .unwrap();
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&to_id)
            .query(&mut src)
            .unwrap();
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut src)
                .unwrap();
            if keys.is_empty() {
                break;
            }
            for k in keys {
                let _: () = redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(to)
                    .arg(&k)
                    .arg(0)
                    .arg(5000)
                    .query(&mut src)
                    .unwrap();
                // Let clients meet the half-moved slot.
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let mut order = vec![to, from];
        order.extend(
            self.node_ports()
                .into_iter()
                .filter(|p| *p != to && *p != from),
        );
        for port in order {
            let _: Result<(), _> = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&to_id)
                .query(&mut self.conn(port));
        }
    }

    /// A plain (not cluster-aware) connection to one node.
    pub fn conn(&self, port: u16) -> redis::Connection {
        self.node(port);
        connect(port)
    }

    /// The tail of every node's log and of `redis-cli --cluster create`.
    pub fn logs(&self) -> String {
        let mut out: String = self.nodes.iter().map(Proc::log_section).collect();
        out.push_str("==== redis-cli --cluster create ====\n");
        out.push_str(&self.create_log);
        for n in self.nodes.iter().filter(|n| n.answering()) {
            if let Ok(text) = query::<String>(n.port, redis::cmd("CLUSTER").arg("NODES")) {
                out.push_str(&format!("==== CLUSTER NODES from {} ====\n{text}", n.port));
                break;
            }
        }
        out
    }

    fn node(&self, port: u16) -> &Proc {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    fn node_mut(&mut self, port: u16) -> &mut Proc {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// A node's cluster id, as it reports it (`None` if it does not answer);
    /// for tests that read `CLUSTER NODES` themselves.
    pub fn node_id(&self, port: u16) -> Option<String> {
        let view = cluster_nodes(port)?;
        view.into_iter().find(|l| l.has("myself")).map(|l| l.id)
    }

    /// Whether `port` is a replica, in its own view (`None` if it does not
    /// answer).
    pub fn is_replica(&self, port: u16) -> Option<bool> {
        let view = cluster_nodes(port)?;
        let me = view.iter().find(|l| l.has("myself"))?;
        Some(me.has("slave") && me.master_id != "-")
    }
}

impl Drop for ClusterSet {
    fn drop(&mut self) {
        for p in &mut self.nodes {
            p.kill();
        }
    }
}
