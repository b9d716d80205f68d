//! etcd members a test starts and owns: one member or a cluster of n on
//! loopback ([`EtcdCluster`]), run from the Debian `etcd-server` package
//! (3.4).
//!
//! Why: an etcd backend and fence store are only as safe as their
//! behaviour across leader elections, member restarts and compaction, so
//! tests need real elections they can trigger and time — kill (SIGKILL),
//! pause (SIGSTOP) or restart one member and wait for the new leader.
//! Every member runs on free loopback ports in its own temp dir (never the
//! machine's etcd), is signalled only through the PID this harness
//! spawned, and is killed when its handle is dropped, even after a panic.
//!
//! Data lives on `/dev/shm` where there is one: etcd fsyncs every commit
//! and 3.4 cannot be told not to; on a disk shared with builds those
//! fsyncs stretch writes past the short leases tests use (the ZooKeeper
//! launcher's `forceSync=no` for the same reason). A killed member's data
//! survives there as it would on disk (only a machine crash, which no test
//! makes, loses tmpfs).
//!
//! Timing: heartbeat 50 ms, election timeout 500 ms, so a killed leader is
//! replaced within about a second.
//!
//! Readiness is asked with `POST /v3/maintenance/status` (the JSON
//! gateway): a member that answers names itself and the leader it follows
//! (0 while electing). Waits are bounded and panic with every member's log
//! tail.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::free_port;
use super::launcher::{tail, ServerProcess};

const HOST: &str = "127.0.0.1";
const ETCD: &str = "/usr/bin/etcd";
/// How long a member or cluster may take to come up before the test panics.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect/read timeout of the harness's status probes: short, so a paused
/// member costs a probe loop little.
const PROBE_TIMEOUT: Duration = Duration::from_millis(700);

/// One HTTP/1.1 `POST` of a JSON body to `port` on loopback; the answer's
/// status and body, or `None` if it does not answer within the probe
/// timeout. For probes and for planting keys from outside fencer.
pub fn post_json(port: u16, path: &str, body: &str) -> Option<(u16, String)> {
    let addr: SocketAddr = format!("{HOST}:{port}").parse().unwrap();
    let mut s = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).ok()?;
    s.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let chunked = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
    Some((
        status,
        if chunked {
            dechunk(rest)?
        } else {
            rest.to_owned()
        },
    ))
}

/// A chunked body, joined.
fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(after.get(..n)?);
        rest = after.get(n + 2..)?;
    }
}

/// What `maintenance/status` says of a member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub member_id: u64,
    /// The leader it follows (its own id if it leads; 0 while electing).
    pub leader: u64,
    pub raft_term: u64,
    /// The store's revision: every write moves it.
    pub revision: i64,
}

impl Status {
    /// The gateway's JSON (64-bit numbers as strings, absent when 0).
    pub fn parse(text: &str) -> Option<Status> {
        let v: serde_json::Value = serde_json::from_str(text).ok()?;
        let num = |v: &serde_json::Value| -> Option<u64> {
            match v {
                serde_json::Value::Null => Some(0),
                serde_json::Value::String(s) => s.parse().ok(),
                other => other.as_u64(),
            }
        };
        Some(Status {
            member_id: num(&v["header"]["member_id"])?,
            leader: num(&v["leader"])?,
            raft_term: num(&v["raftTerm"])?,
            revision: num(&v["header"]["revision"])? as i64,
        })
    }

    pub fn leads(&self) -> bool {
        self.leader != 0 && self.leader == self.member_id
    }
}

// ---------------------------------------------------------------- members

/// One etcd process in its own directory (`data/`, `etcd.log`). Its ports
/// and directory survive a kill, so a restart is the same member with the
/// same data.
struct Member {
    name: String,
    client_port: u16,
    /// A second client port serving TLS (the harness probes the plain one).
    tls_port: Option<u16>,
    peer_port: u16,
    dir: PathBuf,
    /// `--initial-cluster`: every member's name and peer URL.
    cluster: String,
    /// More arguments, given at every start.
    extra: Vec<String>,
    proc: ServerProcess,
}

impl Member {
    fn command(&self) -> Command {
        let mut client = format!("http://{HOST}:{}", self.client_port);
        if let Some(p) = self.tls_port {
            client.push_str(&format!(",https://{HOST}:{p}"));
        }
        let peer = format!("http://{HOST}:{}", self.peer_port);
        let mut cmd = Command::new(ETCD);
        cmd.args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "fencer-test"])
            .args(["--heartbeat-interval", "50"])
            .args(["--election-timeout", "500"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .args(&self.extra)
            .current_dir(&self.dir);
        cmd
    }

    fn spawn(&mut self) {
        let cmd = self.command();
        self.proc.spawn(cmd);
    }

    fn status(&self) -> Option<Status> {
        if !self.proc.answering() {
            return None;
        }
        let (code, body) = post_json(self.client_port, "/v3/maintenance/status", "{}")?;
        (code == 200).then(|| Status::parse(&body)).flatten()
    }

    fn log_section(&self, lines: usize) -> String {
        format!(
            "==== {} {HOST}:{} ({}) ====\n{}",
            self.name,
            self.client_port,
            self.proc.state(),
            tail(&self.proc.logs(), lines)
        )
    }
}

// ---------------------------------------------------------------- cluster

/// n etcd members on loopback. Member `i` is named `m{i}`; indexes are
/// 0-based. Dropping it kills every member.
pub struct EtcdCluster {
    members: Vec<Member>,
    // Declared after `members`: removed once every member is dead.
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// A 3-member cluster.
    pub fn start() -> EtcdCluster {
        EtcdCluster::with_size(3)
    }

    /// `n` members. Returns once every member answers and follows one
    /// leader; panics with the log tails after [`START_TIMEOUT`]. A port
    /// checked free can be taken before etcd binds it: then it starts
    /// again on other ports (three times at most).
    pub fn with_size(n: usize) -> EtcdCluster {
        EtcdCluster::with_args(n, &[])
    }

    /// `n` members started with `extra` arguments too (e.g.
    /// `--auth-token-ttl 1`).
    pub fn with_args(n: usize, extra: &[&str]) -> EtcdCluster {
        EtcdCluster::build(n, extra, false)
    }

    /// One member that also serves TLS on [`Self::tls_endpoints`], with
    /// the certificate and key `server.crt`/`server.key` in `certs` and,
    /// when `client_ca` is set, client certificates required (signed by
    /// `ca.crt` there).
    pub fn with_tls(certs: &Path, client_ca: bool) -> EtcdCluster {
        let file = |f: &str| certs.join(f).display().to_string();
        let mut args = vec![
            "--cert-file".to_owned(),
            file("server.crt"),
            "--key-file".to_owned(),
            file("server.key"),
        ];
        if client_ca {
            args.extend([
                "--client-cert-auth".to_owned(),
                "--trusted-ca-file".to_owned(),
                file("ca.crt"),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        EtcdCluster::build(1, &args, true)
    }

    fn build(n: usize, extra: &[&str], tls: bool) -> EtcdCluster {
        assert!(n >= 1);
        let mut last = String::new();
        for _ in 0..3 {
            let mut builder = tempfile::Builder::new();
            builder.prefix("fencer-etcd-");
            let dir = if Path::new("/dev/shm").is_dir() {
                builder.tempdir_in("/dev/shm")
            } else {
                builder.tempdir()
            }
            .unwrap();
            let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
            let cluster = ports
                .iter()
                .enumerate()
                .map(|(i, (_, peer))| format!("m{i}=http://{HOST}:{peer}"))
                .collect::<Vec<_>>()
                .join(",");
            let members = ports
                .iter()
                .enumerate()
                .map(|(i, &(client_port, peer_port))| {
                    let d = dir.path().join(format!("m{i}"));
                    std::fs::create_dir_all(&d).unwrap();
                    Member {
                        name: format!("m{i}"),
                        client_port,
                        tls_port: tls.then(free_port),
                        peer_port,
                        proc: ServerProcess::new(format!("etcd-m{i}"), d.join("etcd.log")),
                        dir: d,
                        cluster: cluster.clone(),
                        extra: extra.iter().map(|a| a.to_string()).collect(),
                    }
                })
                .collect();
            let mut c = EtcdCluster { members, _dir: dir };
            for m in &mut c.members {
                m.spawn();
            }
            match c.poll(START_TIMEOUT, EtcdCluster::is_healthy) {
                Ok(()) => return c,
                Err(e) if e.contains("address already in use") => last = e,
                Err(e) => panic!("starting etcd ({n} members): {e}"),
            }
        }
        panic!("starting etcd ({n} members): ports taken 3 times: {last}");
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// The client ports, by member index.
    pub fn ports(&self) -> Vec<u16> {
        self.members.iter().map(|m| m.client_port).collect()
    }

    /// `https://127.0.0.1:p` of every member that serves TLS.
    pub fn tls_endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .filter_map(|m| m.tls_port)
            .map(|p| format!("https://{HOST}:{p}"))
            .collect()
    }

    /// `http://127.0.0.1:p` of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.ports()
            .iter()
            .map(|p| format!("http://{HOST}:{p}"))
            .collect()
    }

    pub fn pid(&self, i: usize) -> u32 {
        self.members[i].proc.pid()
    }

    /// Member `i`'s status; `None` if it is dead, paused or silent.
    pub fn status(&self, i: usize) -> Option<Status> {
        self.members[i].status()
    }

    /// The index of the member that leads, one look: of two that say so
    /// (an old leader paused and resumed), the one in the higher term.
    pub fn try_leader(&self) -> Option<usize> {
        (0..self.len())
            .filter_map(|i| {
                let s = self.status(i)?;
                s.leads().then_some((s.raft_term, i))
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
        self.wait(&format!("a leader other than m{old}"), timeout, || {
            found = self.try_leader().filter(|&i| i != old);
            found.is_some()
        });
        found.unwrap()
    }

    /// SIGKILL member `i` (a paused one too): no goodbye to peers or
    /// clients.
    pub fn kill(&mut self, i: usize) {
        self.members[i].proc.kill();
    }

    /// SIGKILLs the current leader; returns its index and when it died.
    pub fn kill_leader(&mut self) -> (usize, Instant) {
        let i = self.leader();
        self.kill(i);
        (i, Instant::now())
    }

    /// Starts member `i` again (killing it first if it runs) on the same
    /// ports and data. Returns once it answers with a leader — or, when the
    /// members alive and unpaused (it included) are no quorum, once it
    /// answers at all.
    pub fn restart(&mut self, i: usize) {
        self.members[i].proc.kill();
        self.members[i].spawn();
        let answering = self.members.iter().filter(|m| m.proc.answering()).count();
        let quorum = answering > self.len() / 2;
        let m = &self.members[i];
        let port = m.client_port;
        self.wait(
            &format!("m{i} to answer after a restart"),
            START_TIMEOUT,
            || {
                if quorum {
                    m.status().is_some_and(|s| s.leader != 0)
                } else {
                    TcpStream::connect((HOST, port)).is_ok()
                }
            },
        );
    }

    /// Starts member `i` of a one-member cluster again on the same ports
    /// with its data gone, as a cluster restored from nothing (or from a
    /// snapshot older than every token issued) would be: revisions start
    /// over.
    pub fn restart_empty(&mut self, i: usize) {
        assert_eq!(self.len(), 1, "only a one-member cluster starts over alone");
        self.members[i].proc.kill();
        let data = self.members[i].dir.join("data");
        if data.exists() {
            std::fs::remove_dir_all(&data).unwrap();
        }
        self.restart(i);
    }

    /// SIGSTOP member `i`: it keeps its sockets but answers nothing, like a
    /// frozen machine.
    pub fn pause(&self, i: usize) {
        self.members[i].proc.pause();
    }

    /// SIGCONT member `i`.
    pub fn resume(&self, i: usize) {
        self.members[i].proc.resume();
    }

    /// Every member runs unpaused, answers, and follows the same leader.
    /// One look.
    pub fn is_healthy(&self) -> bool {
        let mut leaders = self.members.iter().map(Member::status);
        let Some(Some(first)) = leaders.next() else {
            return false;
        };
        first.leader != 0 && leaders.all(|s| s.is_some_and(|s| s.leader == first.leader))
    }

    /// Waits until [`Self::is_healthy`].
    pub fn wait_healthy(&self, timeout: Duration) {
        self.wait("a healthy etcd cluster", timeout, || self.is_healthy());
    }

    /// Every member's log tail, for a panic message.
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| m.log_section(30))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// SIGTERM every member and waits for it.
    pub fn stop(&mut self) {
        for m in &mut self.members {
            m.proc.resume();
            let _ = m.proc.stop(libc::SIGTERM, Duration::from_secs(10));
        }
    }

    /// Polls `f` every 20 ms until it holds, or panics with the logs after
    /// `timeout`.
    fn wait(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
        if let Err(e) = self.poll(timeout, |_| f()) {
            panic!("waiting for {what}: {e}");
        }
    }

    /// Polls `f` until it holds; an error with the logs if a member exited
    /// or `timeout` passed.
    fn poll(&self, timeout: Duration, mut f: impl FnMut(&Self) -> bool) -> Result<(), String> {
        let start = Instant::now();
        loop {
            if f(self) {
                return Ok(());
            }
            if let Some(m) = self
                .members
                .iter()
                .find(|m| m.proc.running() && !m.proc.alive())
            {
                return Err(format!("{} exited:\n{}", m.name, self.logs()));
            }
            if start.elapsed() > timeout {
                return Err(format!("not within {timeout:?}:\n{}", self.logs()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
