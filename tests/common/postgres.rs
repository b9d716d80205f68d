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
use std::process::{Command, Stdio};
use std::time::Duration;

use super::free_port;
use super::launcher::ServerProcess;

const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

pub struct PgServer {
    pub port: u16,
    bin: PathBuf,
    /// `Some((uid, gid))` of the `postgres` OS user when we run as root.
    run_as: Option<(u32, u32)>,
    /// Extra `-c` settings, applied after (so overriding) the defaults.
    settings: Vec<String>,
    // Declared before `dir`: the server dies before its directory goes.
    proc: ServerProcess,
    dir: tempfile::TempDir,
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

        let port = free_port();
        let mut server = PgServer {
            port,
            bin,
            run_as,
            settings: settings.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            proc: ServerProcess::new(
                format!("postgres on port {port}"),
                dir.path().join("postgres.log"),
            )
            .family(),
            dir,
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
        self.proc.pid()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn log_path(&self) -> PathBuf {
        self.proc.log_path().to_path_buf()
    }

    /// Everything initdb and the server wrote so far (all restarts).
    pub fn logs(&self) -> String {
        self.proc.logs()
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
        self.proc.kill();
    }

    /// SIGINT: fast shutdown (roll back open transactions, disconnect
    /// clients, checkpoint) and wait for the postmaster to exit.
    pub fn stop(&mut self) {
        if let Err(e) = self.proc.stop(libc::SIGINT, STOP_TIMEOUT) {
            panic!(
                "postgres did not shut down after SIGINT: {e}\n{}",
                self.logs()
            );
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
        self.proc.pause();
    }

    pub fn resume(&self) {
        self.proc.resume();
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

    /// The postmaster's command line, the same for every (re)start.
    fn command(&self) -> Command {
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
        cmd.current_dir(self.dir.path());
        if let Some((uid, gid)) = self.run_as {
            // Not runuser: it would stay between us and the postmaster.
            cmd.uid(uid).gid(gid).env("HOME", self.dir.path());
        }
        cmd
    }

    fn spawn(&mut self) {
        let cmd = self.command();
        let (port, isready) = (self.port, self.bin.join("pg_isready"));
        let ready = || {
            // TCP first (cheap), then a real protocol-level check: the
            // port may be open while the server still refuses logins
            // (startup, crash recovery).
            TcpStream::connect(("127.0.0.1", port)).is_ok()
                && Command::new(&isready)
                    .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres"])
                    .args(["-p", &port.to_string(), "-t", "2"])
                    .env_remove("PGSERVICE")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false)
        };
        if let Err(e) = self
            .proc
            .start(cmd, START_TIMEOUT, Duration::from_millis(25), ready)
        {
            panic!("{e}\nwhole log:\n{}", self.logs());
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
