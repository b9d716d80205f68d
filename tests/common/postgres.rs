//! A private PostgreSQL server for one test.
//!
//! Like [`super::RedisServer`]: a free port, a temp dir, no shared state
//! with the machine's own instance (which the tests never touch). The
//! `postgres` binary is spawned directly as our child, so `kill`, `stop`,
//! `pause` and `resume` act on the real postmaster, not on a wrapper.
//!
//! Running as root: `initdb` and `postgres` refuse to run as root, so the
//! cluster is created by `runuser -u postgres -- initdb …` in a temp dir
//! chowned to that user. The server itself is *not* started through
//! `runuser`: `runuser` forks and stays behind as a watching parent, so its
//! PID is not the server's and SIGSTOP/SIGKILL sent to it never reach
//! PostgreSQL. Instead the child drops to the `postgres` uid/gid itself
//! (`CommandExt::uid`/`gid`) right before exec.
//!
//! PostgreSQL is a family of processes: the postmaster forks one backend
//! per connection plus a few auxiliary processes. Signalling only the
//! postmaster would leave existing connections fully working while
//! "paused", and backends of a "killed" server would linger holding shared
//! memory. So `pause`, `resume` and `kill` signal the postmaster *and* its
//! children (found through `/proc`), the way a frozen or crashed machine
//! would affect them all. The server stays in the test's process group, so
//! a Ctrl-C of `cargo test` also stops it.

use std::fs::{File, OpenOptions};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

pub struct PgServer {
    pub port: u16,
    bin: PathBuf,
    /// `Some((uid, gid))` of the `postgres` OS user when we run as root.
    run_as: Option<(u32, u32)>,
    /// Extra `-c` settings, applied after (so overriding) the defaults.
    settings: Vec<String>,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl PgServer {
    /// initdb a fresh cluster in a temp dir and start it on a free port,
    /// tuned for speed (`fsync`, `full_page_writes` and
    /// `synchronous_commit` off).
    pub fn start() -> PgServer {
        PgServer::start_with(&[])
    }

    /// Like [`start`](Self::start), with extra `-c name=value` settings
    /// that override the defaults, e.g. `&[("synchronous_commit", "on")]`
    /// for a server that keeps every acknowledged commit across
    /// [`kill`](Self::kill).
    pub fn start_with(settings: &[(&str, &str)]) -> PgServer {
        let bin = bin_dir();
        let run_as = if unsafe { libc::geteuid() } == 0 {
            Some(lookup_user("postgres"))
        } else {
            None
        };
        // As root, the server runs as `postgres` and must be able to reach
        // its directory: /tmp is world-traversable, whatever TMPDIR says.
        let mut builder = tempfile::Builder::new();
        builder.prefix("fencer-pg-");
        let dir = match run_as {
            Some(_) => builder.tempdir_in("/tmp"),
            None => builder.tempdir(),
        }
        .expect("create temp dir for PostgreSQL");
        std::fs::create_dir(dir.path().join("sock")).unwrap();
        for p in [dir.path().to_path_buf(), dir.path().join("sock")] {
            if let Some((uid, gid)) = run_as {
                std::os::unix::fs::chown(&p, Some(uid), Some(gid)).unwrap();
            }
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).unwrap();
        }

        let mut server = PgServer {
            port: free_port(),
            bin,
            run_as,
            settings: settings.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            dir,
            child: None,
        };
        server.initdb();
        server.spawn();
        server
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster's PID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is not running").id()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    /// Everything initdb and the server wrote so far (all restarts).
    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// SIGKILL the postmaster and all its processes: a server crash. The
    /// next start runs crash recovery.
    ///
    /// With the default `synchronous_commit=off`, commits acknowledged in
    /// the last few hundred milliseconds (up to 3 × `wal_writer_delay`) are
    /// lost: their WAL was not yet written when the server died. Start with
    /// `synchronous_commit=on` when a test needs acknowledged commits to
    /// survive a kill. (`fsync=off` only matters for OS crashes, which a
    /// test cannot cause.)
    pub fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id();
        // Freeze the postmaster first so it cannot fork while we collect
        // its children.
        signal(pid, libc::SIGSTOP);
        wait_stopped(pid);
        let family = children_of(pid);
        for &c in &family {
            signal(c, libc::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
        // The backends are not our children (init reaps them); wait until
        // they are gone so a restart does not find their shared memory.
        let start = Instant::now();
        while family.iter().any(|&c| alive(c)) && start.elapsed() < STOP_TIMEOUT {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGINT: fast shutdown (roll back open transactions, disconnect
    /// clients, checkpoint) and wait for the postmaster to exit.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id();
        // A paused server cannot act on SIGINT.
        resume_family(pid);
        signal(pid, libc::SIGINT);
        let start = Instant::now();
        loop {
            if child.try_wait().unwrap().is_some() {
                return;
            }
            if start.elapsed() > STOP_TIMEOUT {
                self.child = Some(child);
                self.kill();
                panic!("postgres did not shut down after SIGINT:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops (if running) and starts again on the same port and data dir.
    /// After [`kill`](Self::kill) this runs crash recovery.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// SIGSTOP the postmaster and its backends: connections stay open but
    /// nothing answers, new connections are not accepted.
    pub fn pause(&self) {
        let pid = self.pid();
        signal(pid, libc::SIGSTOP);
        wait_stopped(pid);
        for c in children_of(pid) {
            signal(c, libc::SIGSTOP);
        }
    }

    pub fn resume(&self) {
        resume_family(self.pid());
    }

    fn initdb(&self) {
        let log = self.log_file();
        let data = self.data_dir();
        let initdb = self.bin.join("initdb");
        let mut cmd = match self.run_as {
            Some(_) => {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(&initdb);
                c
            }
            None => Command::new(&initdb),
        };
        cmd.arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            // Independent of whatever locale the machine has (or lacks).
            .arg("--locale=C")
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        let status = cmd
            .status()
            .expect("initdb must be installed (apt-get install postgresql)");
        assert!(
            status.success(),
            "initdb failed ({status}):\n{}",
            self.logs()
        );
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "postgres already running");
        let log = self.log_file();
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.data_dir())
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.dir.path().join("sock"))
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "synchronous_commit=off",
            ]);
        for setting in &self.settings {
            cmd.arg("-c").arg(setting);
        }
        cmd.current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if let Some((uid, gid)) = self.run_as {
            // Not runuser: it would stay between us and the postmaster.
            cmd.uid(uid).gid(gid).env("HOME", self.dir.path());
        }
        self.child = Some(cmd.spawn().expect("spawn postgres"));
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let start = Instant::now();
        let isready = self.bin.join("pg_isready");
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                panic!("postgres exited with {status}:\n{}", self.logs());
            }
            // TCP first (cheap), then a real protocol-level check: the
            // port may be open while the server still refuses logins
            // (startup, crash recovery).
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                let ok = Command::new(&isready)
                    .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres"])
                    .args(["-p", &self.port.to_string(), "-t", "2"])
                    .env_remove("PGSERVICE")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false);
                if ok {
                    return;
                }
            }
            if start.elapsed() > START_TIMEOUT {
                self.kill();
                panic!(
                    "postgres did not accept connections within {START_TIMEOUT:?}:\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn log_file(&self) -> File {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            resume_family(child.id());
        }
        self.kill();
        // The TempDir field removes the data directory.
    }
}

/// Highest-versioned `/usr/lib/postgresql/<version>/bin` that has initdb.
fn bin_dir() -> PathBuf {
    let mut best: Option<(Vec<u32>, PathBuf)> = None;
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(version) = name
                .split('.')
                .map(str::parse::<u32>)
                .collect::<Result<Vec<_>, _>>()
            else {
                continue;
            };
            let bin = e.path().join("bin");
            if !bin.join("initdb").exists() || !bin.join("postgres").exists() {
                continue;
            }
            if best.as_ref().is_none_or(|(v, _)| version > *v) {
                best = Some((version, bin));
            }
        }
    }
    best.map(|(_, b)| b)
        .expect("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin")
}

pub fn lookup_user(name: &str) -> (u32, u32) {
    let cname = std::ffi::CString::new(name).unwrap();
    let pw = unsafe { libc::getpwnam(cname.as_ptr()) };
    assert!(
        !pw.is_null(),
        "running as root needs an OS user {name:?} to run PostgreSQL"
    );
    unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
}

fn signal(pid: u32, sig: i32) {
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

fn resume_family(pid: u32) {
    for c in children_of(pid) {
        signal(c, libc::SIGCONT);
    }
    signal(pid, libc::SIGCONT);
}

/// (state, ppid) from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ppid ..." — comm may contain spaces and parens.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

fn alive(pid: u32) -> bool {
    matches!(proc_stat(pid), Some((state, _)) if state != 'Z' && state != 'X')
}

fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| matches!(proc_stat(pid), Some((_, ppid)) if ppid == parent))
        .collect()
}

/// Waits (briefly) until `pid` is in the stopped state, so that it can no
/// longer fork.
fn wait_stopped(pid: u32) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        match proc_stat(pid) {
            Some(('T', _)) | None => return,
            Some((s, _)) if s == 'Z' || s == 'X' => return,
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}
