//! `fencer bench --local`: the services a benchmark needs, started as child
//! processes on free loopback ports in a temporary directory — Redis,
//! fencer roles (this very binary) and nginx — and killed when dropped.
//! Anyone can then run the whole benchmark with one command and nothing
//! else running.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process, killed (and its directory removed) on drop.
pub struct Proc {
    pub name: String,
    child: Child,
    pub dir: PathBuf,
    /// Set by [`Proc::terminate_first`]: on drop, SIGTERM and this long to
    /// exit before SIGKILL.
    term_grace: Option<Duration>,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// On drop, asks the process to stop (SIGTERM) and waits up to `grace`
    /// before killing it (a database server that shuts down cleanly).
    pub fn terminate_first(mut self, grace: Duration) -> Proc {
        self.term_grace = Some(grace);
        self
    }

    /// The last lines of the process's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("out.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Not yet reaped, so the PID is still this child's.
        if let (Some(grace), Ok(None)) = (self.term_grace, self.child.try_wait()) {
            let term = Command::new("kill")
                .args(["-s", "TERM", &self.child.id().to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if term.is_ok_and(|s| s.success()) {
                let started = std::time::Instant::now();
                while started.elapsed() < grace {
                    if !matches!(self.child.try_wait(), Ok(None)) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A file removed on drop (a Unix socket a child process leaves behind).
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A port nobody listens on right now, chosen below Linux's ephemeral range
/// (32768-60999), where no outgoing connection can take it as its local
/// port between this check and the server's bind. Successive calls walk
/// different ports, so ports picked for one process before it binds them
/// do not collide. (The test harness uses this too.)
pub fn free_port() -> Result<u16, String> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    static SEED: std::sync::LazyLock<u32> = std::sync::LazyLock::new(rand::random::<u32>);
    for _ in 0..1000 {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = 20_000 + (SEED.wrapping_add(n.wrapping_mul(104_729)) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

pub(super) fn temp_dir(name: &str) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!(
        "fencer-bench-{name}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

pub(super) fn spawn(name: &str, mut cmd: Command, dir: PathBuf) -> Result<Proc, String> {
    let started = std::fs::File::create(dir.join("out.log"))
        .and_then(|log| {
            cmd.stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
        })
        .map_err(|e| format!("cannot start {name} ({:?}): {e}", cmd.get_program()));
    let child = match started {
        Ok(child) => child,
        Err(e) => {
            // Nothing will drop a Proc for it: remove the directory here.
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    };
    Ok(Proc {
        name: name.to_owned(),
        child,
        dir,
        term_grace: None,
    })
}

/// Waits until `addr` accepts TCP connections (or the process died).
pub(super) async fn wait_tcp(proc: &mut Proc, addr: &str) -> Result<(), String> {
    for _ in 0..300 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = proc.child.try_wait() {
            return Err(format!(
                "{} exited ({status}):\n{}",
                proc.name,
                proc.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!(
        "{} did not listen on {addr} within 15 s:\n{}",
        proc.name,
        proc.log_tail()
    ))
}

/// `redis-server` without persistence; returns it and its URL.
pub async fn redis() -> Result<(Proc, String), String> {
    let port = free_port()?;
    let dir = temp_dir("redis")?;
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&dir);
    let mut p = spawn("redis-server", cmd, dir)?;
    wait_tcp(&mut p, &format!("127.0.0.1:{port}")).await?;
    Ok((p, format!("redis://127.0.0.1:{port}/0")))
}

/// A fencer role started from this binary, configured by `env`
/// (`section.field` → `FENCER__SECTION__FIELD`); waits for `ready_addr`.
pub async fn fencer(role: &str, env: &[(&str, String)], ready_addr: &str) -> Result<Proc, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = temp_dir(role)?;
    let mut cmd = Command::new(exe);
    cmd.arg(role)
        .env(SECRET_ENV, SECRET)
        .env("FENCER__SIGNING__SECRET_ENV", SECRET_ENV)
        .env("FENCER__LOG__LEVEL", "warn")
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(
            format!("FENCER__{}", k.to_uppercase().replace('.', "__")),
            v,
        );
    }
    let mut p = spawn(&format!("fencer {role}"), cmd, dir)?;
    wait_tcp(&mut p, ready_addr).await?;
    Ok(p)
}

/// The demo storage (memory) and a gateway in front of it, configured with
/// `gateway_env` as well: the storage's port, the gateway's address, its
/// admin (metrics) address, and the two processes (storage first).
pub async fn storage_and_gateway(
    gateway_env: &[(&str, String)],
) -> Result<(u16, String, String, Vec<Proc>), String> {
    let storage_port = free_port()?;
    let storage_addr = format!("127.0.0.1:{storage_port}");
    let storage = fencer(
        "storage",
        &[
            ("storage.listen", storage_addr.clone()),
            ("storage.backend", "memory".into()),
        ],
        &storage_addr,
    )
    .await?;
    let gateway_addr = format!("127.0.0.1:{}", free_port()?);
    let admin_addr = format!("127.0.0.1:{}", free_port()?);
    let mut env = vec![
        ("gateway.listen", gateway_addr.clone()),
        ("gateway.upstream", format!("http://{storage_addr}")),
        ("admin.listen", admin_addr.clone()),
    ];
    env.extend(gateway_env.iter().cloned());
    let gateway = fencer("gateway", &env, &gateway_addr).await?;
    Ok((
        storage_port,
        gateway_addr,
        admin_addr,
        vec![storage, gateway],
    ))
}

/// The signing secret of every locally started fencer process.
pub const SECRET: &str = "fencer-bench-secret-0123456789abcdef0123456789";
const SECRET_ENV: &str = "FENCER_BENCH_SECRET";

/// nginx as a reverse proxy on `port` in front of `upstream_port`,
/// configured as a careful operator would: one worker (like the sidecar's
/// one thread), upstream keep-alive, no access log.
pub async fn nginx(port: u16, upstream_port: u16) -> Result<Proc, String> {
    let bin = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "nginx"]
        .into_iter()
        .find(|p| !p.starts_with('/') || std::path::Path::new(p).exists())
        .unwrap_or("nginx");
    let dir = temp_dir("nginx")?;
    let d = dir.display();
    let conf = format!(
        "worker_processes 1;\n\
         daemon off;\n\
         pid {d}/nginx.pid;\n\
         error_log {d}/error.log warn;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n\
           access_log off;\n\
           client_body_temp_path {d}/body;\n\
           proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n\
           uwsgi_temp_path {d}/uwsgi;\n\
           scgi_temp_path {d}/scgi;\n\
           upstream storage {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}\n\
           server {{\n\
             listen 127.0.0.1:{port};\n\
             location / {{\n\
               proxy_pass http://storage;\n\
               proxy_http_version 1.1;\n\
               proxy_set_header Connection \"\";\n\
             }}\n\
           }}\n\
         }}\n"
    );
    std::fs::write(dir.join("nginx.conf"), conf).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(bin);
    cmd.arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"));
    let mut p = spawn("nginx", cmd, dir)?;
    wait_tcp(&mut p, &format!("127.0.0.1:{port}")).await?;
    Ok(p)
}

/// Resident memory of a process in KiB (`VmRSS`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// CPU time (user + system) a process has used, in seconds.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields overall, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// CPU time of a process and all its descendants (nginx: master and
/// workers), in seconds.
pub fn tree_cpu_secs(pid: u32) -> Option<f64> {
    let mut total = cpu_secs(pid)?;
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    for task in tasks.flatten() {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
            total += tree_cpu_secs(child).unwrap_or(0.0);
        }
    }
    Some(total)
}
