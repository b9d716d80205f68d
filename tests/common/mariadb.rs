//! A private MariaDB server for one test.
//!
//! Like [`super::postgres::PgServer`]: a free port, a socket and data dir in
//! a temp dir, nothing shared with the machine's own server on 3306 (which
//! the tests never touch). `mariadb-install-db` creates the system tables
//! (~0.7 s); `mariadbd` is spawned directly as our child — one process with
//! threads — so `kill`, `pause` and `resume` act on the real server.
//! Settings are tuned for tests (8 MB redo log, 16 MB buffer pool) but keep
//! `innodb_flush_log_at_trx_commit=1` unless a test asks otherwise, so
//! every acknowledged commit survives [`MariaDb::kill`].
//!
//! `root@127.0.0.1` has no password; [`MariaDb::url`] names database
//! `fencer`, created at start.

use std::fs::{File, OpenOptions};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::free_port;
use super::launcher::ServerProcess;

const START_TIMEOUT: Duration = Duration::from_secs(60);

pub struct MariaDb {
    pub port: u16,
    /// Extra `--name=value` server options, after (so overriding) ours.
    options: Vec<String>,
    /// Run under libfaketime with this `FAKETIME` spec (e.g. `+30s`).
    faketime: Option<String>,
    // Declared before `dir`: the server dies before its directory goes.
    proc: ServerProcess,
    dir: tempfile::TempDir,
}

impl MariaDb {
    pub fn start() -> MariaDb {
        MariaDb::start_with(&[])
    }

    /// With extra server options, e.g. `&[("innodb_flush_log_at_trx_commit", "2")]`.
    pub fn start_with(options: &[(&str, &str)]) -> MariaDb {
        let dir = tempfile::Builder::new()
            .prefix("fencer-mariadb-")
            .tempdir_in("/tmp")
            .expect("create temp dir for MariaDB");
        let port = free_port();
        let mut server = MariaDb {
            port,
            options: options.iter().map(|(k, v)| format!("--{k}={v}")).collect(),
            faketime: None,
            proc: ServerProcess::new(
                format!("mariadbd on port {port}"),
                dir.path().join("mariadb.log"),
            ),
            dir,
        };
        server.install();
        server.spawn();
        server.sql("CREATE DATABASE IF NOT EXISTS fencer");
        server
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/fencer", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn tmp_dir(&self) -> PathBuf {
        let p = self.dir.path().join("tmp");
        std::fs::create_dir_all(&p).expect("create MariaDB tmpdir");
        p
    }

    pub fn log_path(&self) -> PathBuf {
        self.proc.log_path().to_path_buf()
    }

    pub fn logs(&self) -> String {
        self.proc.logs()
    }

    /// Runs SQL with the `mariadb` client over the socket (as root) and
    /// returns its tab-separated output without headers. Panics on failure.
    pub fn sql(&self, sql: &str) -> String {
        let out = Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", self.socket().display()))
            .args(["-uroot", "-N", "-B", "fencer", "-e"])
            .arg(sql)
            .stdin(Stdio::null())
            .output()
            .expect("the mariadb client must be installed");
        // `fencer` may not exist yet on the very first call.
        if !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("Unknown database")
        {
            let out = Command::new("mariadb")
                .arg("--no-defaults")
                .arg(format!("--socket={}", self.socket().display()))
                .args(["-uroot", "-N", "-B", "-e"])
                .arg(sql)
                .stdin(Stdio::null())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{sql}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return String::from_utf8_lossy(&out.stdout).into_owned();
        }
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// SIGKILL: a server crash; the next start runs crash recovery.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Normal shutdown (SIGTERM), waiting for the process to exit (killed
    /// after a minute).
    pub fn stop(&mut self) {
        let _ = self.proc.stop(libc::SIGTERM, START_TIMEOUT);
    }

    /// Stops (if running) and starts again on the same port and data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Restarts the server under libfaketime with `spec` (e.g. `"+30s"`,
    /// `"-10s"`): its clock, and so every lease expiry it computes, jumps.
    pub fn restart_with_faketime(&mut self, spec: &str) {
        self.faketime = Some(spec.to_owned());
        self.restart();
    }

    /// SIGSTOP: connections stay open, nothing answers.
    pub fn pause(&self) {
        self.proc.pause();
    }

    pub fn resume(&self) {
        self.proc.resume();
    }

    fn install(&self) {
        let log = self.log_file();
        let status = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.data_dir().display()))
            // Its own tmpdir: concurrent installs sharing /tmp clash on
            // temporary table names ("Unknown table 'mysql.tmp_user_sys'").
            .arg(format!("--tmpdir={}", self.tmp_dir().display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .args(["--skip-name-resolve", "--innodb-log-file-size=8M"])
            .args(user_arg())
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .status()
            .expect("mariadb-install-db must be installed (apt-get install mariadb-server)");
        assert!(
            status.success(),
            "mariadb-install-db failed:\n{}",
            self.logs()
        );
    }

    /// The server's command line, the same for every (re)start (plus
    /// libfaketime once a test asked for it).
    fn command(&self) -> Command {
        let mut cmd = match &self.faketime {
            Some(spec) => {
                let mut c = Command::new("faketime");
                c.arg("-f").arg(spec).arg("mariadbd");
                c
            }
            None => Command::new("mariadbd"),
        };
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", self.data_dir().display()))
            .arg(format!("--port={}", self.port))
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!(
                "--pid-file={}",
                self.dir.path().join("pid").display()
            ))
            .arg(format!("--tmpdir={}", self.tmp_dir().display()))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--innodb-log-file-size=8M",
                "--innodb-buffer-pool-size=16M",
                "--max-connections=500",
                "--skip-log-bin",
            ])
            .args(user_arg())
            .args(&self.options)
            .current_dir(self.dir.path());
        cmd
    }

    fn spawn(&mut self) {
        let cmd = self.command();
        let (port, socket) = (self.port, self.socket());
        let ready = || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
                && Command::new("mariadb")
                    .arg("--no-defaults")
                    .arg(format!("--socket={}", socket.display()))
                    .args(["-uroot", "-e", "SELECT 1"])
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
            panic!("{e}");
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

/// mariadbd refuses to run as root unless told to.
fn user_arg() -> Vec<&'static str> {
    if unsafe { libc::geteuid() } == 0 {
        vec!["--user=root"]
    } else {
        vec![]
    }
}
