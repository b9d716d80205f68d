//! Test harness: real services the tests start and own.
//!
//! Every test starts its own `redis-server` (free port, temp dir, no shared
//! state with the machine's instance) and its own `fencer` processes, so
//! tests are isolated and can kill, pause and restart what they started.

#![allow(dead_code)]

pub mod clients;
pub mod dev;
pub mod etcd;
pub mod fence_rules;
pub mod launcher;
pub mod mariadb;
pub mod postgres;
pub mod redis_topology;
pub mod rw_check;
pub mod shared;
pub mod tcp_fault;
pub mod upstream;
pub mod zookeeper;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const SECRET: &str = "test-secret-0123456789-abcdefghijklmnopqrstuvwxyz";

/// The `fencer` binary under test: this build's, or the one named by
/// `FENCER_TEST_BIN` (to run a regression test against an older release
/// and watch it fail).
pub fn fencer_bin() -> String {
    std::env::var("FENCER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_fencer").to_owned())
}

/// Fails the test, naming what to install, unless `cmd args` runs and
/// exits 0: `who` (e.g. "the examples") needs `what`.
pub fn require_tool(who: &str, what: &str, install: &str, cmd: &str, args: &[&str]) {
    let ok = Command::new(cmd)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{who} need {what} (`{cmd} {}` failed): install {install}",
        args.join(" ")
    );
}

/// A free port below the ephemeral range (see `fencer::bench::local::free_port`).
pub fn free_port() -> u16 {
    fencer::bench::local::free_port().unwrap()
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}

use launcher::signal;

// ---------------------------------------------------------------- Redis

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persistence {
    /// `--save '' --appendonly no`: a restart loses everything.
    Off,
    /// AOF with `appendfsync always`: a restart (even after SIGKILL) keeps
    /// every acknowledged write.
    Aof,
}

pub struct RedisServer {
    pub port: u16,
    persistence: Persistence,
    extra: Vec<String>,
    password: Option<String>,
    // Declared before `dir`: the server dies before its directory goes.
    proc: launcher::ServerProcess,
    dir: tempfile::TempDir,
}

impl RedisServer {
    pub fn start(persistence: Persistence) -> RedisServer {
        RedisServer::start_with(persistence, &[], None)
    }

    /// With extra `redis-server` arguments and an optional password.
    pub fn start_with(
        persistence: Persistence,
        extra: &[String],
        password: Option<&str>,
    ) -> RedisServer {
        let mut extra = extra.to_vec();
        if let Some(p) = password {
            extra.extend(["--requirepass".to_owned(), p.to_owned()]);
        }
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let mut server = RedisServer {
            port,
            persistence,
            extra,
            password: password.map(str::to_owned),
            proc: launcher::ServerProcess::new(
                format!("redis on port {port}"),
                dir.path().join("stderr.log"),
            ),
            dir,
        };
        server.spawn();
        server
    }

    /// The server's command line, the same for every (re)start.
    fn command(&self) -> Command {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--save")
            .arg("")
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"));
        match self.persistence {
            Persistence::Off => cmd.args(["--appendonly", "no"]),
            Persistence::Aof => cmd.args(["--appendonly", "yes", "--appendfsync", "always"]),
        };
        cmd.args(&self.extra);
        cmd
    }

    fn spawn(&mut self) {
        let cmd = self.command();
        let url = self.url();
        let ready = || {
            redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection())
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
        };
        if let Err(e) = self.proc.start(
            cmd,
            Duration::from_secs(10),
            Duration::from_millis(20),
            ready,
        ) {
            let log = std::fs::read_to_string(self.dir.path().join("redis.log"));
            panic!("{e}\nredis.log:\n{}", log.unwrap_or_default());
        }
    }

    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap()
    }

    /// SIGKILL: no shutdown save, no goodbye to clients.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Starts again on the same port and data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub fn pause(&self) {
        self.proc.pause();
    }

    pub fn resume(&self) {
        self.proc.resume();
    }
}

/// Runs `openssl` with `args` in `dir`; panics with its stderr on failure.
pub fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Signs `NAME.csr` in `dir` with the CA `ca.crt`/`ca.key` there into
/// `NAME.crt` (2 days), with the extensions in the file `ext`.
/// A client certificate `client.crt` / `client.key` in `dir` (made by
/// [`make_certs`]), for `subject`, signed by its CA for client auth.
pub fn make_client_cert(dir: &std::path::Path, subject: &str) {
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "client.key",
            "-out",
            "client.csr",
            "-subj",
            subject,
        ],
    );
    sign_csr(dir, "client", "client.ext");
}

pub fn sign_csr(dir: &std::path::Path, name: &str, ext: &str) {
    let (csr, crt) = (format!("{name}.csr"), format!("{name}.crt"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            ext,
        ],
    );
}

/// A test CA and a server certificate for 127.0.0.1/localhost (files
/// `ca.crt`, `server.crt`, `server.key`), readable by the PostgreSQL user.
pub fn make_certs() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("fencer-tls-")
        .tempdir_in("/tmp")
        .unwrap();
    let d = dir.path();
    let run = |args: &[&str]| openssl(d, args);
    std::fs::write(
        d.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=fencer-test-ca",
        "-days",
        "2",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    sign_csr(d, "server", "san.ext");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(d.join("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    if unsafe { libc::geteuid() } == 0 {
        let (uid, gid) = postgres::lookup_user("postgres");
        std::os::unix::fs::chown(d.join("server.key"), Some(uid), Some(gid)).unwrap();
        std::os::unix::fs::chown(d.join("server.crt"), Some(uid), Some(gid)).unwrap();
    }
    dir
}

// ---------------------------------------------------------------- fencer

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
    /// Redis through Sentinel (`backend.redis.mode = "sentinel"`); the test
    /// passes the sentinels and master name as settings.
    RedisSentinel,
    /// Redis Cluster (`backend.redis.mode = "cluster"`); the test passes the
    /// nodes as a setting.
    RedisCluster,
    /// RedLock over independent masters; the test passes their URLs.
    RedLock,
    Postgres,
    /// ZooKeeper; the test passes the ensemble's connect string.
    ZooKeeper,
    /// MySQL/MariaDB.
    MySql,
    /// etcd; the test passes the members' endpoints.
    Etcd,
}

impl Backend {
    /// `backend.kind`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis | Backend::RedisSentinel | Backend::RedisCluster => "redis",
            Backend::RedLock => "redlock",
            Backend::Postgres => "postgres",
            Backend::ZooKeeper => "zookeeper",
            Backend::MySql => "mysql",
            Backend::Etcd => "etcd",
        }
    }
}

pub struct Fencer {
    /// The main listener: lock API (sidecar), gateway, or storage.
    pub api: String,
    /// The egress proxy (sidecar only).
    pub proxy: String,
    pub admin: String,
    pub api_port: u16,
    pub proxy_port: u16,
    pub admin_port: u16,
    role: &'static str,
    health: String,
    config: Option<PathBuf>,
    env: Vec<(String, String)>,
    log: PathBuf,
    _dir: tempfile::TempDir,
    child: Option<Child>,
    /// RLIMIT_NOFILE for the process, when limited.
    nofile: Option<u64>,
    pub http: reqwest::Client,
}

pub struct Resp {
    pub status: u16,
    pub body: Value,
}

impl Resp {
    pub fn code(&self) -> &str {
        self.body["error"].as_str().unwrap_or("")
    }
    pub fn token(&self) -> u64 {
        self.body["token"]
            .as_u64()
            .unwrap_or_else(|| panic!("no token in {} {}", self.status, self.body))
    }
    pub fn lease(&self) -> String {
        self.body["lease_id"].as_str().unwrap().to_owned()
    }
}

impl Fencer {
    /// Starts `fencer sidecar` with the given backend and extra settings
    /// (`("sidecar.default_ttl_ms", "500")` → `FENCER__SIDECAR__DEFAULT_TTL_MS`).
    /// `url` is the backend's URL (Redis or PostgreSQL) where it has one.
    pub fn sidecar(backend: Backend, url: Option<&str>, extra: &[(&str, &str)]) -> Fencer {
        Fencer::sidecar_env(backend, url, extra, &[])
    }

    /// A sidecar with extra process environment (e.g. LD_PRELOAD).
    pub fn sidecar_env(
        backend: Backend,
        url: Option<&str>,
        extra: &[(&str, &str)],
        process_env: &[(&str, &str)],
    ) -> Fencer {
        let mut env: Vec<(String, String)> = vec![
            ("backend.kind".into(), backend.name().into()),
            ("signing.secret_env".into(), "FENCER_TEST_SECRET".into()),
            ("log.level".into(), "fencer=debug,info".into()),
        ];
        match (backend, url) {
            (Backend::Redis, Some(url)) => env.push(("backend.redis.url".into(), url.into())),
            (Backend::Postgres, Some(url)) => env.push(("backend.postgres.url".into(), url.into())),
            (Backend::MySql, Some(url)) => env.push(("backend.mysql.url".into(), url.into())),
            _ => {}
        }
        for (k, v) in extra {
            env.push(((*k).into(), (*v).into()));
        }
        for (k, v) in process_env {
            env.push((format!("!{k}"), (*v).into()));
        }
        Fencer::start("sidecar", env, None)
    }

    /// Starts a sidecar with a TOML config file (for list settings such as
    /// routes, which environment variables cannot express).
    pub fn sidecar_with_config(backend: Backend, toml: &str, extra: &[(&str, &str)]) -> Fencer {
        let mut env: Vec<(String, String)> = vec![
            ("backend.kind".into(), backend.name().into()),
            ("signing.secret_env".into(), "FENCER_TEST_SECRET".into()),
        ];
        for (k, v) in extra {
            env.push(((*k).into(), (*v).into()));
        }
        Fencer::start("sidecar", env, Some(toml))
    }

    /// Starts `fencer gateway` (in front of `upstream`) with extra settings.
    pub fn gateway(upstream: &str, extra: &[(&str, &str)]) -> Fencer {
        let mut env: Vec<(String, String)> = vec![
            ("gateway.upstream".into(), upstream.into()),
            // Later entries (the test's) override this default.
            ("gateway.fence_store".into(), "memory".into()),
            ("signing.secret_env".into(), "FENCER_TEST_SECRET".into()),
            ("log.level".into(), "fencer=debug,info".into()),
        ];
        for (k, v) in extra {
            env.push(((*k).into(), (*v).into()));
        }
        Fencer::start("gateway", env, None)
    }

    /// A gateway with a TOML config file as well.
    pub fn gateway_with_config(upstream: &str, toml: &str, extra: &[(&str, &str)]) -> Fencer {
        let mut env: Vec<(String, String)> = vec![
            ("gateway.upstream".into(), upstream.into()),
            ("gateway.fence_store".into(), "memory".into()),
            ("signing.secret_env".into(), "FENCER_TEST_SECRET".into()),
        ];
        for (k, v) in extra {
            env.push(((*k).into(), (*v).into()));
        }
        Fencer::start("gateway", env, Some(toml))
    }

    /// Starts `fencer storage` (the demo key-value storage).
    pub fn storage(extra: &[(&str, &str)]) -> Fencer {
        let env = extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Fencer::start("storage", env, None)
    }

    /// `fencer inject` (HTTPS on `api_port`) with `extra` settings; the
    /// caller gives the certificate files (`inject.tls_cert_file` …).
    pub fn injector(extra: &[(&str, &str)]) -> Fencer {
        let env = extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Fencer::start("inject", env, None)
    }

    /// `fencer gateway` whose open files are limited to `nofile`
    /// (RLIMIT_NOFILE, soft and hard), to test it at the descriptor limit.
    pub fn gateway_with_nofile(upstream: &str, extra: &[(&str, &str)], nofile: u64) -> Fencer {
        let mut env: Vec<(String, String)> = vec![
            ("gateway.upstream".into(), upstream.into()),
            ("gateway.fence_store".into(), "memory".into()),
            ("signing.secret_env".into(), "FENCER_TEST_SECRET".into()),
        ];
        for (k, v) in extra {
            env.push(((*k).into(), (*v).into()));
        }
        Fencer::start_limited("gateway", env, None, Some(nofile))
    }

    fn start(role: &'static str, env: Vec<(String, String)>, config: Option<&str>) -> Fencer {
        Fencer::start_limited(role, env, config, None)
    }

    fn start_limited(
        role: &'static str,
        env: Vec<(String, String)>,
        config: Option<&str>,
        nofile: Option<u64>,
    ) -> Fencer {
        // A port checked free can still be taken before the process binds
        // it (by another test's process): start again on other ports.
        let mut last = String::new();
        for _ in 0..5 {
            let mut f = Fencer::prepare(role, env.clone(), config);
            f.nofile = nofile;
            match f.try_spawn() {
                Ok(()) => return f,
                Err(e) if e.contains("Address already in use") => last = e,
                Err(e) => panic!("{e}"),
            }
        }
        panic!("no free ports after 5 attempts: {last}");
    }

    fn prepare(role: &'static str, env: Vec<(String, String)>, config: Option<&str>) -> Fencer {
        let dir = tempfile::tempdir().unwrap();
        let config = config.map(|toml| {
            let path = dir.path().join("fencer.toml");
            std::fs::write(&path, toml).unwrap();
            path
        });
        let api_port = free_port();
        let proxy_port = free_port();
        let admin_port = free_port();
        let api = format!("http://127.0.0.1:{api_port}");
        let admin = format!("http://127.0.0.1:{admin_port}");
        let health = if role == "storage" {
            format!("{api}/healthz")
        } else {
            format!("{admin}/healthz")
        };
        let f = Fencer {
            api,
            proxy: format!("http://127.0.0.1:{proxy_port}"),
            admin,
            api_port,
            proxy_port,
            admin_port,
            role,
            health,
            config,
            env,
            log: dir.path().join("fencer.log"),
            _dir: dir,
            child: None,
            nofile: None,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .pool_max_idle_per_host(64)
                // The API closes a keep-alive connection idle for its
                // header timeout (10 s); a pooled connection reused just
                // then fails with IncompleteMessage. Retire them earlier,
                // as README tells clients to.
                .pool_idle_timeout(Duration::from_secs(5))
                .build()
                .unwrap(),
        };
        f
    }

    fn spawn(&mut self) {
        if let Err(e) = self.try_spawn() {
            panic!("{e}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(fencer_bin());
        let listen_var = match self.role {
            "sidecar" => "FENCER__SIDECAR__LISTEN",
            "gateway" => "FENCER__GATEWAY__LISTEN",
            "inject" => "FENCER__INJECT__LISTEN",
            _ => "FENCER__STORAGE__LISTEN",
        };
        if let Some(path) = &self.config {
            cmd.arg("--config").arg(path);
        }
        cmd.arg(self.role)
            .env_remove("RUST_LOG")
            .env("FENCER_TEST_SECRET", SECRET)
            .env(listen_var, format!("127.0.0.1:{}", self.api_port))
            .env(
                "FENCER__PROXY__LISTEN",
                format!("127.0.0.1:{}", self.proxy_port),
            )
            .env(
                "FENCER__ADMIN__LISTEN",
                format!("127.0.0.1:{}", self.admin_port),
            )
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in &self.env {
            match k.strip_prefix('!') {
                // A raw process variable.
                Some(raw) => cmd.env(raw, v),
                None => cmd.env(
                    format!("FENCER__{}", k.replace('.', "__").to_uppercase()),
                    v,
                ),
            };
        }
        if let Some(n) = self.nofile {
            use std::os::unix::process::CommandExt;
            let limit = libc::rlimit {
                rlim_cur: n as libc::rlim_t,
                rlim_max: n as libc::rlim_t,
            };
            // SAFETY: setrlimit is async-signal-safe; nothing else runs
            // between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        self.child = Some(cmd.spawn().unwrap());
        let health = self.health.clone();
        let log = self.log.clone();
        let child = self.child.as_mut().unwrap();
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "fencer exited with {status}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                ));
            }
            if http_get_ok(&health) {
                return Ok(());
            }
            assert!(
                start.elapsed() < Duration::from_secs(40),
                "fencer {} did not start: {}",
                self.role,
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The logs once they contain `needle`, or as they are after 5 s: a line
    /// logged while a request was answered can reach the file after the
    /// answer (the log writer is a thread of its own).
    pub fn logs_with(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let logs = self.logs();
            if logs.contains(needle) || Instant::now() > deadline {
                return logs;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGTERM and wait; returns the exit code.
    pub fn terminate(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        signal(child.id(), libc::SIGTERM);
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            if start.elapsed() > Duration::from_secs(15) {
                let _ = child.kill();
                panic!("fencer did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.terminate();
        self.spawn();
    }

    /// Sets (or replaces) a raw process variable for the next start.
    pub fn set_process_env(&mut self, name: &str, value: &str) {
        let key = format!("!{name}");
        self.env.retain(|(k, _)| *k != key);
        self.env.push((key, value.to_owned()));
    }

    /// SIGKILL (a crash), then start again on the same ports.
    pub fn crash_and_restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub async fn post(&self, path: &str, body: Value) -> Resp {
        self.post_raw(path, body.to_string().into_bytes()).await
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> Resp {
        let r = self
            .http
            .post(format!("{}{}", self.api, path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request failed");
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        let body = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("non-JSON response {status}: {text:?}"));
        Resp { status, body }
    }

    pub async fn get(&self, path: &str) -> Resp {
        let r = self
            .http
            .get(format!("{}{}", self.api, path))
            .send()
            .await
            .expect("request failed");
        let status = r.status().as_u16();
        let body = r.json().await.unwrap();
        Resp { status, body }
    }

    /// Waits (up to 30 s) for `/readyz`: a database backend creates its
    /// schema, a topology is found, in the background.
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = format!("{}/readyz", self.admin);
        while Instant::now() < deadline {
            if http_ok(&url) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("sidecar not ready: {}", self.logs());
    }

    /// Acquires `key` (10 s TTL), retrying while the backend is
    /// unavailable (after a restart), for up to 30 s.
    pub async fn acquire_eventually(&self, key: &str) -> Resp {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self.acquire(key, 10_000, 0).await;
            if r.status == 200 {
                return r;
            }
            assert_eq!(r.code(), "backend_unavailable", "{}", r.body);
            assert!(Instant::now() < deadline, "no recovery: {}", r.body);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn path(key: &str, op: &str) -> String {
        let enc = percent_encode(key);
        if op.is_empty() {
            format!("/v1/locks/{enc}")
        } else {
            format!("/v1/locks/{enc}/{op}")
        }
    }

    pub async fn acquire(&self, key: &str, ttl_ms: u64, wait_ms: u64) -> Resp {
        self.post(
            &Self::path(key, "acquire"),
            json!({"ttl_ms": ttl_ms, "wait_ms": wait_ms}),
        )
        .await
    }

    pub async fn release(&self, key: &str, lease: &str) -> Resp {
        self.post(&Self::path(key, "release"), json!({ "lease_id": lease }))
            .await
    }

    /// An acquire with `body` sent in a task of its own: its answer, and
    /// when it came (`None`: no answer — the sidecar was killed, say).
    pub fn acquire_in_background(
        &self,
        key: &str,
        body: Value,
    ) -> tokio::task::JoinHandle<Option<(Resp, Instant)>> {
        let url = format!("{}{}", self.api, Self::path(key, "acquire"));
        let http = self.http.clone();
        tokio::spawn(async move {
            let r = http.post(url).json(&body).send().await.ok()?;
            let status = r.status().as_u16();
            let body = r.json().await.ok()?;
            Some((Resp { status, body }, Instant::now()))
        })
    }

    pub async fn renew(&self, key: &str, lease: &str, ttl_ms: u64) -> Resp {
        self.post(
            &Self::path(key, "renew"),
            json!({ "lease_id": lease, "ttl_ms": ttl_ms }),
        )
        .await
    }

    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Sum of every sample of `name` whose labels contain all of `labels`.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        metric_sum(&self.metrics().await, name, labels)
    }
}

impl Drop for Fencer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Any HTTP request; the body is parsed as JSON when it is JSON.
pub async fn send(
    client: &reqwest::Client,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Resp {
    let mut req = client.request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req
            .header("content-type", "application/json")
            .body(b.to_owned());
    }
    let r = req.send().await.expect("request failed");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Resp { status, body }
}

/// A token in the `v1` wire form (lease id in clear), which fencer 7195c76
/// and this build's gateway both verify: for regression tests that must
/// run against the old release too.
pub fn sign_v1(key: &str, token: u64, lease: &str) -> String {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
    use base64::Engine;
    use hmac::Mac;
    let mut m = Vec::new();
    for part in ["v1", "k1", key, &token.to_string(), lease] {
        m.extend_from_slice(&(part.len() as u32).to_be_bytes());
        m.extend_from_slice(part.as_bytes());
    }
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(&m);
    let sig = B64.encode(mac.finalize().into_bytes());
    format!("v1.k1.{token}.{lease}.{}.{sig}", B64.encode(key))
}

/// Polls `f` every 20 ms until it is true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// Peak resident memory of a process (VmHWM), in KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap()
}

pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            let metric = l.split([' ', '{']).next().unwrap_or("");
            metric == name
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn percent_encode(key: &str) -> String {
    let mut out = String::new();
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~:".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `GET url` answered 200 (plain TCP, usable outside a runtime).
pub fn http_ok(url: &str) -> bool {
    http_get_ok(url)
}

/// One integer from a query against a test PostgreSQL.
pub async fn pg_query_i64(url: &str, sql: &str) -> i64 {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// A plain connection to the server at `url`, its driver spawned.
pub async fn pg_connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// Waits (up to 5 s) until at least `n` sessions of the server at `url`
/// wait on a lock (a row lock held by another transaction).
pub async fn pg_until_lock_waiters(url: &str, n: i64) {
    let c = pg_connect(url).await;
    for _ in 0..500 {
        let row = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap();
        if row.get::<_, i64>(0) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("fewer than {n} statements waiting on a row lock");
}

fn http_get_ok(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let (host, path) = rest.split_once('/').unwrap();
    let Ok(mut s) = TcpStream::connect(host) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200")
}

// ---------------------------------------------------------------- faults

/// A TCP proxy in front of Redis that can swallow the reply to the next
/// script call and cut the connection: the sidecar then cannot know whether
/// its acquire ran.
pub struct FaultProxy {
    pub port: u16,
    drop_next_script_reply: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl FaultProxy {
    pub fn start(upstream_port: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let drop_flag = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, st) = (drop_flag.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream_port)) else {
                    continue;
                };
                let armed = Arc::new(AtomicBool::new(false));
                // client -> server: arm when a script call passes while the
                // fault is requested.
                {
                    let (mut c, mut s) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                    let (d, armed) = (d.clone(), armed.clone());
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 65536];
                        loop {
                            let n = match c.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            let chunk = &buf[..n];
                            if d.load(Ordering::SeqCst)
                                && chunk.windows(7).any(|w| w.eq_ignore_ascii_case(b"EVALSHA"))
                            {
                                d.store(false, Ordering::SeqCst);
                                armed.store(true, Ordering::SeqCst);
                            }
                            if s.write_all(chunk).is_err() {
                                break;
                            }
                        }
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    });
                }
                // server -> client: when armed, swallow the reply and cut.
                {
                    let (mut c, mut s) = (client, server);
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 65536];
                        loop {
                            let n = match s.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if armed.load(Ordering::SeqCst) {
                                let _ = c.shutdown(std::net::Shutdown::Both);
                                let _ = s.shutdown(std::net::Shutdown::Both);
                                break;
                            }
                            if c.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = c.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        FaultProxy {
            port,
            drop_next_script_reply: drop_flag,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn drop_next_script_reply(&self) {
        self.drop_next_script_reply.store(true, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}
