//! Logging must never stop fencer (issue 26 item 5): stdout/stderr into a
//! pipe whose reader has gone, or whose reader has stopped reading, must
//! not keep a sidecar or gateway from answering, nor from obeying SIGTERM
//! and releasing its leases; a subcommand whose stdout goes away must not
//! panic. Real `fencer` processes with real pipes; a real Redis, so that
//! "released" is checked by another sidecar taking the key at once.

mod common;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{fencer_bin, free_port, http_ok, Backend, Fencer, Persistence, RedisServer, SECRET};
use serde_json::json;

/// Well under the TTLs below: a sidecar that takes longer to exit after
/// SIGTERM is not obeying it.
const EXIT_WITHIN: Duration = Duration::from_secs(6);
const TTL_MS: u64 = 120_000;

/// A pipe (read end, write end), close-on-exec (a child gets only the copy
/// it is given as stdout/stderr).
fn pipe() -> (File, File) {
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let [r, w] = fds.map(|fd| File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
    (r, w)
}

/// A `fencer` process whose stdout and stderr both go into one pipe the
/// test holds the read end of. Killed on drop.
struct Piped {
    child: Child,
    api: String,
    admin: String,
}

impl Drop for Piped {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Piped {
    fn start(role: &str, settings: &[(&str, String)]) -> (Piped, File) {
        Piped::spawn(role, settings, false)
    }

    /// As `start`, the process and its threads on CPU 0 only.
    fn start_on_cpu0(role: &str, settings: &[(&str, String)]) -> (Piped, File) {
        Piped::spawn(role, settings, true)
    }

    fn spawn(role: &str, settings: &[(&str, String)], cpu0: bool) -> (Piped, File) {
        let (reader, writer) = pipe();
        let (api_port, proxy_port, admin_port) = (free_port(), free_port(), free_port());
        let listen_var = match role {
            "sidecar" => "FENCER__SIDECAR__LISTEN",
            _ => "FENCER__GATEWAY__LISTEN",
        };
        let mut cmd = Command::new(fencer_bin());
        cmd.arg(role)
            .env_remove("RUST_LOG")
            .env("FENCER_TEST_SECRET", SECRET)
            .env("FENCER__SIGNING__SECRET_ENV", "FENCER_TEST_SECRET")
            .env(listen_var, format!("127.0.0.1:{api_port}"))
            .env("FENCER__PROXY__LISTEN", format!("127.0.0.1:{proxy_port}"))
            .env("FENCER__ADMIN__LISTEN", format!("127.0.0.1:{admin_port}"))
            .stdin(Stdio::null())
            .stdout(writer.try_clone().unwrap())
            .stderr(writer);
        for (k, v) in settings {
            cmd.env(
                format!("FENCER__{}", k.replace('.', "__").to_uppercase()),
                v,
            );
        }
        if cpu0 {
            use std::os::unix::process::CommandExt;
            // In the child before exec: every thread it starts inherits it.
            // sched_setaffinity is a plain system call, safe after fork.
            unsafe {
                cmd.pre_exec(|| {
                    pin_to_cpu0(0);
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().unwrap();
        // The command holds the parent's copies of the write end: gone, so
        // the pipe's only writer is the child.
        drop(cmd);
        let p = Piped {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
            admin: format!("http://127.0.0.1:{admin_port}"),
        };
        (p, reader)
    }

    fn wait_healthy(&mut self) {
        let url = format!("{}/healthz", self.admin);
        let start = Instant::now();
        while !http_ok(&url) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("fencer exited at start-up: {status}");
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no /healthz");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit code if it exits within [`EXIT_WITHIN`].
    fn terminate(&mut self) -> Result<Option<i32>, String> {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let start = Instant::now();
        while start.elapsed() < EXIT_WITHIN {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Ok(status.code());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!("still running {EXIT_WITHIN:?} after SIGTERM"))
    }
}

/// Reads log lines until one contains `what` (the reader is alive for
/// start-up, as a `| logger` is).
fn read_until(reader: File, what: &str) -> BufReader<File> {
    let mut lines = BufReader::new(reader);
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = lines.read_line(&mut line).unwrap();
        assert!(n > 0, "log ended before {what:?}: {seen}");
        seen.push_str(&line);
        if line.contains(what) {
            return lines;
        }
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

async fn acquire(http: &reqwest::Client, api: &str, key: &str) -> Result<u16, String> {
    let r = http
        .post(format!("{api}/v1/locks/{key}/acquire"))
        .json(&json!({"ttl_ms": TTL_MS, "wait_ms": 0}))
        .send()
        .await
        .map_err(|e| format!("acquire: {}", e.without_url()))?;
    Ok(r.status().as_u16())
}

/// After the first sidecar's exit: another one gets the key at once, so
/// the exit released it (its TTL is minutes away).
async fn assert_released(redis: &RedisServer, key: &str) {
    let other = Fencer::sidecar(Backend::Redis, Some(&redis.url()), &[]);
    let r = other.acquire(key, 5_000, 0).await;
    assert_eq!(r.status, 200, "key still held after the exit: {}", r.body);
}

/// The case: the log reader (`| logger`, a journal) has gone;
/// SIGTERM must still stop the sidecar and release what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_and_releases_when_the_log_reader_has_gone() {
    let redis = RedisServer::start(Persistence::Off);
    let (mut sidecar, reader) = Piped::start(
        "sidecar",
        &[
            ("backend.kind", "redis".into()),
            ("backend.redis.url", redis.url()),
            ("log.level", "info".into()),
        ],
    );
    let lines = read_until(reader, "sidecar listening");
    sidecar.wait_healthy();
    drop(lines);
    let http = client();
    assert_eq!(
        acquire(&http, &sidecar.api, "pipe-gone").await.unwrap(),
        200
    );
    let code = sidecar
        .terminate()
        .unwrap_or_else(|e| panic!("sidecar {e}"));
    assert_eq!(code, Some(0), "exit code after SIGTERM");
    assert_released(&redis, "pipe-gone").await;
}

/// The other variant: the reader is alive but has stopped reading (a
/// stopped `tee`, a stalled collector), so the pipe is full. The lock API
/// keeps answering (log lines are dropped, and counted), and SIGTERM
/// still stops the sidecar and releases its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_pipe_blocks_neither_requests_nor_sigterm() {
    let redis = RedisServer::start(Persistence::Off);
    let (mut sidecar, reader) = Piped::start(
        "sidecar",
        &[
            ("backend.kind", "redis".into()),
            ("backend.redis.url", redis.url()),
            // One line per refused acquire: the pipe fills quickly.
            ("log.level", "fencer=debug,info".into()),
        ],
    );
    sidecar.wait_healthy();
    let http = client();
    assert_eq!(
        acquire(&http, &sidecar.api, "pipe-full").await.unwrap(),
        200
    );
    // Each refusal logs the key: long keys, fewer requests.
    let busy = format!("busy-{}", "x".repeat(400));
    assert_eq!(acquire(&http, &sidecar.api, &busy).await.unwrap(), 200);
    let dropped = || async {
        let text = http
            .get(format!("{}/metrics", sidecar.admin))
            .send()
            .await
            .map_err(|e| format!("/metrics: {e}"))?
            .text()
            .await
            .map_err(|e| format!("/metrics: {e}"))?;
        Ok::<f64, String>(common::metric_sum(
            &text,
            "fencer_log_lines_dropped_total",
            &[("reason", "queue_full")],
        ))
    };
    // 64 KiB of pipe, then the log queue: a few thousand lines at most.
    let mut sent = 0;
    loop {
        let batch: Vec<_> = (0..64)
            .map(|_| acquire(&http, &sidecar.api, &busy))
            .collect();
        for r in futures_util::future::join_all(batch).await {
            let status = r.unwrap_or_else(|e| {
                panic!(
                    "lock API stopped answering with the log pipe full after {sent} requests: {e}"
                )
            });
            assert_eq!(status, 409);
            sent += 1;
        }
        if dropped().await.unwrap() > 0.0 {
            break;
        }
        assert!(sent < 20_000, "no log line dropped after {sent} requests");
    }
    // Still answering, lines still being dropped rather than waited for.
    assert_eq!(acquire(&http, &sidecar.api, &busy).await.unwrap(), 409);
    let code = sidecar
        .terminate()
        .unwrap_or_else(|e| panic!("sidecar {e}"));
    assert_eq!(code, Some(0), "exit code after SIGTERM");
    // The reader stayed open all along.
    drop(reader);
    assert_released(&redis, "pipe-full").await;
}

/// The gateway (and the injector) share the process's logging and signal
/// handling: a gateway whose log reader has gone obeys SIGTERM too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_obeys_sigterm_when_the_log_reader_has_gone() {
    let (mut gateway, reader) = Piped::start(
        "gateway",
        &[
            ("gateway.upstream", "http://127.0.0.1:9".into()),
            ("gateway.fence_store", "memory".into()),
            ("log.level", "info".into()),
        ],
    );
    let lines = read_until(reader, "gateway listening");
    gateway.wait_healthy();
    drop(lines);
    let code = gateway
        .terminate()
        .unwrap_or_else(|e| panic!("gateway {e}"));
    assert_eq!(code, Some(0), "exit code after SIGTERM");
}

/// A role obeys SIGTERM from the moment it says it is listening: the
/// handlers are registered before any listener binds. They were once
/// registered by a spawned task on its first poll, and on a busy machine a
/// multi-threaded gateway answered its health check before any worker had
/// polled it; a SIGTERM then killed it outright (no exit code). The
/// gateway runs here on one CPU beside two spinning threads, so that its
/// workers wait for the CPU as they did in CI, and the signal is sent the
/// moment the line is read.
#[test]
fn sigterm_the_moment_a_role_says_listening_stops_it_cleanly() {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin_to_cpu0(0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let mut codes = Vec::new();
    for _ in 0..ROUNDS {
        let (mut gateway, reader) = Piped::start_on_cpu0(
            "gateway",
            &[
                ("gateway.upstream", "http://127.0.0.1:9".into()),
                ("gateway.fence_store", "memory".into()),
                ("runtime.worker_threads", "2".into()),
                ("log.level", "info".into()),
            ],
        );
        let lines = read_until(reader, "gateway listening");
        let code = gateway.terminate();
        drop(lines);
        codes.push(code);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in spinners {
        s.join().unwrap();
    }
    let bad: Vec<_> = codes.iter().filter(|c| **c != Ok(Some(0))).collect();
    assert!(
        bad.is_empty(),
        "{} of {ROUNDS} gateways did not exit 0 on a SIGTERM sent at their listening line: {bad:?}",
        bad.len()
    );
}

const ROUNDS: usize = 20;

/// Pins the calling thread (pid 0) or a process to CPU 0. No assert:
/// it runs between fork and exec too.
fn pin_to_cpu0(pid: libc::pid_t) {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn check_config(stdout: Stdio) -> Child {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/sidecar.toml");
    Command::new(fencer_bin())
        // The example's secret file is mounted in a pod, not here.
        .args(["--config", config, "check-config", "--no-files"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn assert_quiet_exit(child: Child) {
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "check-config with its stdout gone: {}; stderr: {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
}

/// `fencer check-config | head -1`: the reader has gone before most of the
/// output was written. Not a panic (it was: exit 101), not a signal.
#[test]
fn check_config_into_a_closed_pipe_exits_quietly() {
    // Deterministic: the reader is gone before the first write.
    let (reader, writer) = pipe();
    drop(reader);
    assert_quiet_exit(check_config(writer.into()));

    // As `head -1` does it: one line read, then the pipe closed.
    let mut child = check_config(Stdio::piped());
    let mut lines = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    lines.read_line(&mut first).unwrap();
    assert!(first.starts_with("# configuration ok"), "{first}");
    drop(lines);
    assert_quiet_exit(child);
}
