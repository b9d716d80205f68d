//! ZooKeeper servers a test starts and owns: a standalone server
//! ([`ZooKeeperServer`]) or an ensemble of n members ([`ZooKeeperEnsemble`]),
//! run from the Debian `zookeeper` package's jars.
//!
//! Why: the ZooKeeper backend is only as safe as its behaviour across leader
//! elections and session expiries, so tests need real elections they can
//! trigger and time: kill (SIGKILL), pause (SIGSTOP) or restart one member
//! and wait for the new leader. Every server runs on free loopback ports in
//! its own temp dir (never the machine's ZooKeeper), is signalled only
//! through the PID this harness spawned, and is killed when its handle is
//! dropped, even after a panic.
//!
//! Timing: tickTime 200 ms, syncLimit 5 (a leader or follower that hears
//! nothing from its peer for 1 s gives up on it), initLimit 20 (4 s to sync
//! after an election), minSessionTimeout 1000 ms, so elections and session
//! expiries take about a second. Election notifications back off to at most
//! 1 s (`zookeeper.fastleader.maxNotificationInterval`; the default 60 s
//! makes a member restarted after a long outage rejoin slowly) and an
//! election connection gives up after 1 s (`zookeeper.cnxTimeout`, default
//! 5 s, which a paused peer would otherwise cost every election).
//!
//! Readiness is asked with the `srvr` four-letter word: a serving member
//! says `Mode: standalone|leader|follower`; one that is electing or syncing
//! says it is "not currently serving requests". Waits are bounded and panic
//! with every member's log tail.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::launcher::{tail, ServerProcess};
use super::{free_port, signal};

const HOST: &str = "127.0.0.1";
const JAVA: &str = "/usr/bin/java";
const MAIN: &str = "org.apache.zookeeper.server.quorum.QuorumPeerMain";
/// tickTime: ZooKeeper's time unit (heartbeats, session expiry buckets).
pub const TICK_MS: u64 = 200;
/// How long a server or ensemble may take to come up before the test panics.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect/read timeout of the harness's `srvr` probes: short, so a paused
/// member costs a probe loop little.
const PROBE_TIMEOUT: Duration = Duration::from_millis(700);

/// The installed jars of the Debian `zookeeper` package and its
/// dependencies, `:`-joined (the same list `fencer bench` starts with).
pub fn classpath() -> String {
    fencer::bench::servers::zookeeper_classpath()
        .unwrap_or_else(|e| panic!("{e}: tests/run.sh installs the Debian package zookeeper"))
}

/// A four-letter word's whole answer (the server closes the connection
/// after it), or `None` if `port` does not answer within the probe timeout.
pub fn four_letter(port: u16, word: &str) -> Option<String> {
    let addr: SocketAddr = format!("{HOST}:{port}").parse().unwrap();
    let mut s = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).ok()?;
    s.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
    s.write_all(word.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// `srvr`'s answer, parsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Srvr {
    /// "standalone", "leader" or "follower"; `None` while not serving.
    pub mode: Option<String>,
    /// The last zxid: epoch in the high 32 bits, counter in the low 32.
    pub zxid: Option<u64>,
}

impl Srvr {
    pub fn parse(text: &str) -> Srvr {
        let mut out = Srvr::default();
        for line in text.lines() {
            if let Some(v) = line.strip_prefix("Mode:") {
                out.mode = Some(v.trim().to_owned());
            } else if let Some(v) = line.strip_prefix("Zxid:") {
                let v = v.trim();
                out.zxid = u64::from_str_radix(v.strip_prefix("0x").unwrap_or(v), 16).ok();
            }
        }
        out
    }
}

/// Runs one `zkCli` command (`ZooKeeperMain -server <connect> <args…>`,
/// e.g. `["create", "/x", "data"]` or `["get", "/x"]`) and returns its
/// output; about 0.5 s. To look at or plant znodes from outside fencer.
pub fn zk_cli(connect: &str, args: &[&str]) -> std::process::Output {
    Command::new(JAVA)
        .args([
            "-Xmx64m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:-UsePerfData",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "-cp",
            &classpath(),
            "org.apache.zookeeper.ZooKeeperMain",
            "-server",
            connect,
        ])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("java must be installed (Debian package zookeeper)")
}

// ---------------------------------------------------------------- members

/// One ZooKeeper server process in its own directory (`zoo.cfg`, `data/`,
/// `zookeeper.log`). Its ports and directory survive a kill, so a restart
/// is the same member with the same data.
struct Member {
    /// 1-based server id (`myid`).
    id: usize,
    client_port: u16,
    dir: PathBuf,
    proc: ServerProcess,
}

impl Member {
    /// Writes `zoo.cfg` (and `myid` when in an ensemble); `peers` are the
    /// (quorum, election) ports of every member, empty for standalone.
    fn new(
        id: usize,
        client_port: u16,
        dir: PathBuf,
        peers: &[(u16, u16)],
        extra: &[String],
    ) -> Member {
        let data = dir.join("data");
        std::fs::create_dir_all(&data).unwrap();
        let mut cfg = vec![
            format!("tickTime={TICK_MS}"),
            "initLimit=20".into(),
            "syncLimit=5".into(),
            format!("dataDir={}", data.display()),
            format!("clientPort={client_port}"),
            format!("clientPortAddress={HOST}"),
            "admin.enableServer=false".into(),
            "minSessionTimeout=1000".into(),
            "maxSessionTimeout=120000".into(),
            "reconfigEnabled=false".into(),
            // Every test client connects from 127.0.0.1; the default cap is
            // 60 connections per address.
            "maxClientCnxns=0".into(),
            "4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,conf".into(),
            // No fsync per transaction: a killed member's log survives in
            // the page cache (only an OS crash, which no test makes, would
            // lose it), and fsyncs on a disk shared with builds stretched
            // writes past the short leases some tests use (issue 29).
            "forceSync=no".into(),
        ];
        for (j, (quorum, election)) in peers.iter().enumerate() {
            cfg.push(format!("server.{}={HOST}:{quorum}:{election}", j + 1));
        }
        cfg.extend(extra.iter().cloned());
        std::fs::write(dir.join("zoo.cfg"), cfg.join("\n") + "\n").unwrap();
        if !peers.is_empty() {
            std::fs::write(data.join("myid"), format!("{id}\n")).unwrap();
        }
        Member {
            id,
            client_port,
            proc: ServerProcess::new(format!("zk-{id}"), dir.join("zookeeper.log")),
            dir,
        }
    }

    /// Starts the JVM (log appended to `zookeeper.log`); does not wait:
    /// the ensemble decides when its members serve.
    fn spawn(&mut self) {
        let mut cmd = Command::new(JAVA);
        cmd.args([
            "-Xmx128m",
            "-Xss512k",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:-UsePerfData",
            "-Djava.net.preferIPv4Stack=true",
            "-Dzookeeper.admin.enableServer=false",
            "-Dzookeeper.fastleader.maxNotificationInterval=1000",
            "-Dzookeeper.cnxTimeout=1000",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            "-cp",
            &classpath(),
            MAIN,
        ])
        .arg(self.dir.join("zoo.cfg"))
        .current_dir(&self.dir);
        self.proc.spawn(cmd);
    }

    /// Spawned and not exited (an exited child is a zombie until reaped).
    fn alive(&self) -> bool {
        self.proc.alive()
    }

    /// Alive and not paused: worth asking.
    fn answering(&self) -> bool {
        self.proc.answering()
    }

    fn srvr(&self) -> Option<Srvr> {
        if !self.answering() {
            return None;
        }
        four_letter(self.client_port, "srvr").map(|t| Srvr::parse(&t))
    }

    fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// SIGKILL (after SIGCONT, so a paused member dies too).
    fn kill(&mut self) {
        self.proc.kill();
    }

    fn pause(&self) {
        self.proc.pause();
    }

    fn resume(&self) {
        self.proc.resume();
    }

    fn log(&self) -> String {
        self.proc.logs()
    }

    fn log_section(&self, lines: usize) -> String {
        format!(
            "==== zk-{} {HOST}:{} ({}) ====\n{}",
            self.id,
            self.client_port,
            self.proc.state(),
            tail(&self.log(), lines)
        )
    }
}

// ---------------------------------------------------------------- ensemble

/// n ZooKeeper members on loopback (n = 1: a standalone server). Member `i`
/// has server id i+1; indexes below are 0-based. Dropping it kills every
/// member.
pub struct ZooKeeperEnsemble {
    members: Vec<Member>,
    // Declared after `members`: removed once every member is dead.
    _dir: tempfile::TempDir,
}

impl ZooKeeperEnsemble {
    /// A 3-member ensemble.
    pub fn start() -> ZooKeeperEnsemble {
        ZooKeeperEnsemble::with_size(3)
    }

    /// `n` members (1: standalone). Returns once every member serves (one
    /// leader and n-1 followers); panics with the log tails after
    /// [`START_TIMEOUT`]. A port checked free can be taken by someone else
    /// before ZooKeeper binds it, so a member that exits with "Address
    /// already in use" means: start again on other ports.
    pub fn with_size(n: usize) -> ZooKeeperEnsemble {
        ZooKeeperEnsemble::with_config(n, &[])
    }

    /// A standalone server that also serves TLS, on the returned port, with
    /// the PEM key and certificate in `server.pem` and the CA in `ca.crt`
    /// (ZooKeeper's own PEM key store, Netty connection factory).
    pub fn with_tls(certs: &Path) -> (ZooKeeperEnsemble, u16) {
        let port = free_port();
        let extra = [
            format!("secureClientPort={port}"),
            format!("secureClientPortAddress={HOST}"),
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory".into(),
            format!(
                "ssl.keyStore.location={}",
                certs.join("server.pem").display()
            ),
            "ssl.keyStore.type=PEM".into(),
            format!("ssl.trustStore.location={}", certs.join("ca.crt").display()),
            "ssl.trustStore.type=PEM".into(),
            "ssl.clientAuth=none".into(),
        ];
        (ZooKeeperEnsemble::with_config(1, &extra), port)
    }

    /// `n` members with `extra` lines in every member's `zoo.cfg`.
    pub fn with_config(n: usize, extra: &[String]) -> ZooKeeperEnsemble {
        assert!(n >= 1);
        let mut last = String::new();
        for _ in 0..3 {
            let dir = tempfile::Builder::new()
                .prefix("fencer-zk-")
                .tempdir()
                .unwrap();
            let peers: Vec<(u16, u16)> = if n > 1 {
                (0..n).map(|_| (free_port(), free_port())).collect()
            } else {
                Vec::new()
            };
            let members = (0..n)
                .map(|i| {
                    let d = dir.path().join(format!("member-{i}"));
                    Member::new(i + 1, free_port(), d, &peers, extra)
                })
                .collect();
            let mut ens = ZooKeeperEnsemble { members, _dir: dir };
            for m in &mut ens.members {
                m.spawn();
            }
            match ens.poll_healthy(START_TIMEOUT) {
                Ok(()) => return ens,
                Err(e) if e.contains("Address already in use") => last = e,
                Err(e) => panic!("starting ZooKeeper ({n} members): {e}"),
            }
        }
        panic!("starting ZooKeeper ({n} members): ports taken 3 times: {last}");
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// The temp dir holding every member's directory.
    pub fn dir(&self) -> &Path {
        self._dir.path()
    }

    /// The client ports, by member index.
    pub fn ports(&self) -> Vec<u16> {
        self.members.iter().map(|m| m.client_port).collect()
    }

    /// `127.0.0.1:p1,127.0.0.1:p2,…`: every member's client address.
    pub fn connect_string(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{HOST}:{}", m.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn pid(&self, i: usize) -> u32 {
        self.members[i].pid()
    }

    /// Member `i`'s `srvr` answer; `None` if it is dead, paused or silent.
    pub fn srvr(&self, i: usize) -> Option<Srvr> {
        self.members[i].srvr()
    }

    /// "standalone", "leader" or "follower"; `None` if member `i` does not
    /// serve.
    pub fn mode(&self, i: usize) -> Option<String> {
        self.srvr(i).and_then(|s| s.mode)
    }

    pub fn modes(&self) -> Vec<Option<String>> {
        (0..self.len()).map(|i| self.mode(i)).collect()
    }

    /// Member `i`'s last zxid, one look. A follower reports the zxid of the
    /// last transaction it applied, so right after an election it may still
    /// be in the old epoch until the new leader's first write.
    pub fn try_zxid(&self, i: usize) -> Option<u64> {
        self.srvr(i).and_then(|s| s.zxid)
    }

    /// Member `i`'s last zxid (epoch in the high 32 bits), waiting up to
    /// 10 s for it to serve.
    pub fn zxid(&self, i: usize) -> u64 {
        let mut found = None;
        self.wait(
            &format!("zk-{} to report its zxid", i + 1),
            Duration::from_secs(10),
            || {
                found = self.try_zxid(i);
                found.is_some()
            },
        );
        found.unwrap()
    }

    /// The index of the member that leads (a standalone server leads
    /// itself), one look. A leader paused and resumed says "leader" until it
    /// notices it lost its followers (≤ syncLimit); of two, the one with the
    /// higher epoch wins.
    pub fn try_leader(&self) -> Option<usize> {
        (0..self.len())
            .filter_map(|i| {
                let s = self.srvr(i)?;
                matches!(s.mode.as_deref(), Some("leader" | "standalone"))
                    .then(|| (s.zxid.unwrap_or(0) >> 32, i))
            })
            .max()
            .map(|(_, i)| i)
    }

    /// The leader's index, waiting up to [`START_TIMEOUT`] for there to be
    /// one.
    pub fn leader(&self) -> usize {
        let mut found = None;
        self.wait("a leader", START_TIMEOUT, || {
            found = self.try_leader();
            found.is_some()
        });
        found.unwrap()
    }

    /// Waits until a member other than `old` leads; returns its index.
    pub fn wait_new_leader(&self, old: usize, timeout: Duration) -> usize {
        let mut found = None;
        self.wait(
            &format!("a leader other than zk-{}", old + 1),
            timeout,
            || {
                found = self.try_leader().filter(|&i| i != old);
                found.is_some()
            },
        );
        found.unwrap()
    }

    /// SIGKILL member `i` (a paused one too): no goodbye to peers or
    /// clients.
    pub fn kill(&mut self, i: usize) {
        self.members[i].kill();
    }

    /// SIGKILLs the current leader; returns its index and when the signal
    /// went out.
    pub fn kill_leader(&mut self) -> (usize, Instant) {
        let i = self.leader();
        let pid = self.members[i].pid();
        signal(pid, libc::SIGCONT);
        signal(pid, libc::SIGKILL);
        let t = Instant::now();
        self.members[i].kill();
        (i, t)
    }

    /// Starts member `i` again (killing it first if it runs) on the same
    /// ports and data directory. Returns once it serves — or, when the
    /// members alive and unpaused (it included) are no quorum, once its
    /// client port answers at all (it cannot serve until a quorum is back).
    pub fn restart(&mut self, i: usize) {
        self.members[i].kill();
        self.members[i].spawn();
        let answering = (0..self.len())
            .filter(|&j| self.members[j].answering())
            .count();
        let quorum = answering > self.len() / 2;
        let what = format!(
            "zk-{} to {} after a restart",
            i + 1,
            if quorum { "serve" } else { "answer" }
        );
        let m = &self.members[i];
        self.wait(&what, START_TIMEOUT, || {
            four_letter(m.client_port, "srvr")
                .is_some_and(|t| !quorum || Srvr::parse(&t).mode.is_some())
        });
        if !self.members[i].alive() {
            panic!("zk-{} exited after a restart:\n{}", i + 1, self.logs());
        }
    }

    /// Kills member `i`, deletes its data directory (snapshots, logs and
    /// the sessions in them; `myid` is kept) and starts it again on the
    /// same ports: a member rebuilt from empty. Rebuilding a whole ensemble
    /// this way starts its zxids over (epoch 1).
    pub fn restart_empty(&mut self, i: usize) {
        self.members[i].kill();
        let data = self.members[i].dir.join("data");
        let myid = std::fs::read(data.join("myid")).ok();
        std::fs::remove_dir_all(&data).unwrap();
        std::fs::create_dir_all(&data).unwrap();
        if let Some(id) = myid {
            std::fs::write(data.join("myid"), id).unwrap();
        }
        self.restart(i);
    }

    /// SIGSTOP member `i`: it keeps its sockets and sessions but answers
    /// nothing, like a frozen machine.
    pub fn pause(&self, i: usize) {
        self.members[i].pause();
    }

    /// SIGCONT member `i`.
    pub fn resume(&self, i: usize) {
        self.members[i].resume();
    }

    pub fn resume_all(&self) {
        for m in &self.members {
            m.resume();
        }
    }

    /// Every member runs unpaused and serves: one leader and n-1 followers
    /// (n = 1: standalone). One look.
    pub fn is_healthy(&self) -> bool {
        if !self.members.iter().all(Member::answering) {
            return false;
        }
        let modes = self.modes();
        let count = |m: &str| modes.iter().filter(|x| x.as_deref() == Some(m)).count();
        if self.len() == 1 {
            count("standalone") == 1
        } else {
            count("leader") == 1 && count("follower") == self.len() - 1
        }
    }

    /// Waits until [`is_healthy`](Self::is_healthy); panics with the log
    /// tails after `timeout`, or at once if a member is not running (a
    /// killed member must be restarted first).
    pub fn wait_healthy(&self, timeout: Duration) {
        if let Err(e) = self.poll_healthy(timeout) {
            panic!("{e}");
        }
    }

    fn poll_healthy(&self, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            if let Some(m) = self.members.iter().find(|m| !m.alive()) {
                return Err(format!("zk-{} is not running:\n{}", m.id, self.logs()));
            }
            if self.is_healthy() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "ZooKeeper not healthy after {timeout:?} (modes {:?}):\n{}",
                    self.modes(),
                    self.logs()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Polls `f` every 20 ms; panics with the modes and log tails after
    /// `timeout`.
    fn wait(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
        let start = Instant::now();
        while !f() {
            if start.elapsed() > timeout {
                panic!(
                    "timed out after {timeout:?} waiting for {what} (modes {:?}):\n{}",
                    self.modes(),
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills every member (also done on drop).
    pub fn stop(&mut self) {
        for m in &mut self.members {
            m.kill();
        }
    }

    /// The last 40 lines of every member's log, with its state.
    pub fn logs(&self) -> String {
        self.members.iter().map(|m| m.log_section(40)).collect()
    }

    /// Member `i`'s whole log.
    pub fn log(&self, i: usize) -> String {
        self.members[i].log()
    }
}

impl Drop for ZooKeeperEnsemble {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------- standalone

/// One standalone ZooKeeper server (an ensemble of one, which runs
/// standalone: no `server.N` lines). Dropping it kills it.
pub struct ZooKeeperServer {
    pub port: u16,
    ens: ZooKeeperEnsemble,
}

impl ZooKeeperServer {
    /// Starts on a free port in a temp dir; returns once it serves.
    pub fn start() -> ZooKeeperServer {
        let ens = ZooKeeperEnsemble::with_size(1);
        ZooKeeperServer {
            port: ens.ports()[0],
            ens,
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn connect_string(&self) -> String {
        self.ens.connect_string()
    }

    pub fn pid(&self) -> u32 {
        self.ens.pid(0)
    }

    /// SIGKILL: no snapshot on the way out, no goodbye to clients (their
    /// sessions live on in the data directory until they expire).
    pub fn kill(&mut self) {
        self.ens.kill(0);
    }

    /// Starts again (killing it first if it runs) on the same port and data
    /// directory; returns once it serves.
    pub fn restart(&mut self) {
        self.ens.restart(0);
    }

    /// SIGSTOP.
    pub fn pause(&self) {
        self.ens.pause(0);
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.ens.resume(0);
    }

    /// The `srvr` answer; `None` if dead, paused or silent.
    pub fn srvr(&self) -> Option<Srvr> {
        self.ens.srvr(0)
    }

    /// The last zxid, waiting up to 10 s for the server to serve.
    pub fn zxid(&self) -> u64 {
        self.ens.zxid(0)
    }

    pub fn logs(&self) -> String {
        self.ens.logs()
    }
}
