//! `fencer lock KEY -- CMD` (issue 30 item 2), against `fencer dev` and a
//! Redis sidecar: the lease lives exactly as long as CMD, a lost lease
//! stops CMD, and every way of ending has its documented exit code.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// `fencer dev` on free ports; SIGKILLed when dropped (if still running).
struct Dev {
    api: String,
    proxy: String,
    child: Child,
}

impl Dev {
    fn start() -> Dev {
        let (mut cmd, [api, proxy, _, _, admin]) = common::dev::Dev::command();
        let child = cmd
            .env_remove("RUST_LOG")
            // A lost lease shows on the hold stream at the next beat.
            .env("FENCER__SIDECAR__HOLD_HEARTBEAT_MS", "200")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_until("fencer dev ready", Duration::from_secs(30), || {
            http_ok(&format!("http://127.0.0.1:{admin}/readyz"))
        });
        Dev {
            api: format!("http://127.0.0.1:{api}"),
            proxy: format!("http://127.0.0.1:{proxy}"),
            child,
        }
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How `fencer lock` ended.
struct Ended {
    code: Option<i32>,
    stderr: String,
    took: Duration,
}

/// `fencer lock --api API ARGS…`, its stderr captured.
fn lock_cmd(api: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(fencer_bin());
    cmd.arg("lock")
        .arg("--api")
        .arg(api)
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("FENCER_API")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Runs `fencer lock` to its end (at most 60 s).
async fn run_lock(api: &str, args: &[&str]) -> Ended {
    let child = lock_cmd(api, args).spawn().unwrap();
    finish(child, Instant::now()).await
}

async fn finish(child: tokio::process::Child, started: Instant) -> Ended {
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("fencer lock did not end within 60 s")
        .unwrap();
    Ended {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        took: started.elapsed(),
    }
}

/// `fencer lock ARGS… -- sh -c 'exec sleep 300'`: a CMD that runs for
/// minutes unless stopped, started and holding its lease.
struct LongCmd {
    child: tokio::process::Child,
    /// CMD's own pid (`exec`: the shell becomes the sleep).
    pid: u32,
    _dir: tempfile::TempDir,
}

impl LongCmd {
    async fn start(api: &str, args: &[&str]) -> LongCmd {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = format!("echo $$ > {}; exec sleep 300", pid_file.display());
        let mut all = args.to_vec();
        all.extend(["--", "sh", "-c", &script]);
        let child = lock_cmd(api, &all).spawn().unwrap();
        wait_for_file(&pid_file).await;
        // Past the write of the pid file: the exec has happened.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pid = read(&pid_file).trim().parse().unwrap();
        LongCmd {
            child,
            pid,
            _dir: dir,
        }
    }

    /// Waits for `fencer lock` (timed from `since`): it must exit 70 with
    /// the lost-lease line, CMD stopped, within 5 s.
    async fn assert_stopped_as_lost(self, since: Instant, key: &str, reason: &str) {
        let e = finish(self.child, since).await;
        assert_eq!(e.code, Some(70), "{}", e.stderr);
        let line = format!("fencer lock: lease on {key} lost (");
        assert!(e.stderr.starts_with(&line), "{}", e.stderr);
        assert!(e.stderr.contains(reason), "{}", e.stderr);
        assert!(
            e.took < Duration::from_secs(5),
            "CMD stopped late: {:?}",
            e.took
        );
        assert!(!launcher::alive(self.pid), "CMD {} still running", self.pid);
    }
}

async fn acquire(api: &str, key: &str, wait_ms: u64) -> Resp {
    send(
        &reqwest::Client::new(),
        "POST",
        &format!("{api}/v1/locks/{key}/acquire"),
        &[],
        Some(&format!(r#"{{"wait_ms":{wait_ms},"ttl_ms":30000}}"#)),
    )
    .await
}

async fn release(api: &str, key: &str, lease: &str) -> Resp {
    send(
        &reqwest::Client::new(),
        "POST",
        &format!("{api}/v1/locks/{key}/release"),
        &[],
        Some(&format!(r#"{{"lease_id":"{lease}"}}"#)),
    )
    .await
}

/// The key is free: another client gets it at once (and gives it back).
async fn assert_free(api: &str, key: &str) {
    let r = acquire(api, key, 0).await;
    assert_eq!(r.status, 200, "{key} not free: {}", r.body);
    assert_eq!(release(api, key, &r.lease()).await.status, 200);
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

async fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process this test started.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// A CMD script that releases its own lease through the lock API (the
/// lease's loss, as the sidecar sees it) and then keeps working; `$2` is
/// what it does on SIGTERM.
fn self_releasing(api: &str, dir: &Path, on_term: &str) -> String {
    format!(
        "trap '{on_term}' TERM; echo $$ > {pid}; \
         curl -s -o /dev/null -X POST {api}/v1/locks/$FENCER_KEY/release \
           -H 'content-type: application/json' -d \"{{\\\"lease_id\\\":\\\"$FENCER_LEASE\\\"}}\"; \
         while :; do sleep 0.05; done",
        pid = dir.join("pid").display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_runs_cmd_with_the_lease_and_passes_its_status() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().unwrap();
    let env_file = dir.path().join("env");
    let code_file = dir.path().join("code");
    let script = format!(
        "echo \"$FENCER_KEY|$FENCER_TOKEN|$FENCER_LEASE|$FENCER_FENCING_TOKEN\" > {env}; \
         curl -s -o /dev/null -w '%{{http_code}}' -X PUT -H \"Fencing-Lease: $FENCER_LEASE\" \
           -H 'content-type: application/json' -d '{{\"balance\":1}}' {proxy}/kv/accounts/1 > {code}; \
         exit 7",
        env = env_file.display(),
        code = code_file.display(),
        proxy = dev.proxy,
    );
    let e = run_lock(
        &dev.api,
        &["account:1", "--ttl", "5s", "--", "sh", "-c", &script],
    )
    .await;
    assert_eq!(e.code, Some(7), "CMD's status passes through: {}", e.stderr);
    assert_eq!(e.stderr, "", "quiet by default");
    let env = read(&env_file);
    let parts: Vec<&str> = env.trim().split('|').collect();
    assert_eq!(parts.len(), 4, "{env}");
    assert_eq!(parts[0], "account:1");
    assert!(parts[1].parse::<u64>().unwrap() > 0, "{env}");
    assert!(!parts[2].is_empty() && !parts[3].is_empty(), "{env}");
    assert_eq!(
        read(&code_file),
        "200",
        "the write through the proxy with FENCER_LEASE"
    );
    assert_free(&dev.api, "account:1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_key_is_free_the_moment_lock_returns() {
    let dev = Dev::start();
    for _ in 0..10 {
        let e = run_lock(&dev.api, &["cron", "--wait", "0", "--", "true"]).await;
        assert_eq!(e.code, Some(0), "{}", e.stderr);
        assert_free(&dev.api, "cron").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_wait_0_on_a_held_key_exits_75_at_once() {
    let dev = Dev::start();
    let held = acquire(&dev.api, "report", 0).await;
    assert_eq!(held.status, 200);
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let touch = format!("touch {}", ran.display());
    let e = run_lock(
        &dev.api,
        &["report", "--wait", "0", "--", "sh", "-c", &touch],
    )
    .await;
    assert_eq!(e.code, Some(75), "{}", e.stderr);
    assert!(e.took < Duration::from_secs(5), "took {:?}", e.took);
    assert!(e.stderr.contains("report is held"), "{}", e.stderr);
    assert!(!ran.exists(), "CMD must not run without the lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_waits_for_the_key_and_runs_once_it_is_released() {
    let dev = Dev::start();
    let held = acquire(&dev.api, "batch", 0).await;
    assert_eq!(held.status, 200);
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let touch = format!("touch {}", ran.display());
    let started = Instant::now();
    let mut child = lock_cmd(
        &dev.api,
        &["batch", "--wait", "20s", "--", "sh", "-c", &touch],
    )
    .spawn()
    .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(child.try_wait().unwrap().is_none(), "still waiting");
    assert!(!ran.exists());
    assert_eq!(release(&dev.api, "batch", &held.lease()).await.status, 200);
    let e = finish(child, started).await;
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    assert!(ran.exists());
    assert_free(&dev.api, "batch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_lost_lease_sends_cmd_sigterm_and_exits_70() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().unwrap();
    let term = dir.path().join("term");
    let on_term = format!("echo got-term > {}; exit 143", term.display());
    let script = self_releasing(&dev.api, dir.path(), &on_term);
    let e = run_lock(&dev.api, &["job", "--ttl", "5s", "--", "sh", "-c", &script]).await;
    assert_eq!(e.code, Some(70), "{}", e.stderr);
    assert_eq!(read(&term).trim(), "got-term", "CMD got SIGTERM");
    assert!(
        e.stderr.starts_with("fencer lock: lease on job lost (")
            && e.stderr.contains("stopped CMD"),
        "{}",
        e.stderr
    );
    assert_eq!(e.stderr.lines().count(), 1, "one line: {}", e.stderr);
    assert!(
        e.took < Duration::from_secs(4),
        "known at the next beat: {:?}",
        e.took
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_cmd_ignoring_sigterm_is_killed_after_the_grace() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().unwrap();
    let script = self_releasing(&dev.api, dir.path(), "");
    let e = run_lock(
        &dev.api,
        &[
            "job", "--ttl", "5s", "--grace", "700ms", "--", "sh", "-c", &script,
        ],
    )
    .await;
    assert_eq!(e.code, Some(70), "{}", e.stderr);
    assert!(
        e.took >= Duration::from_millis(700),
        "grace given: {:?}",
        e.took
    );
    assert!(
        e.took < Duration::from_secs(6),
        "then SIGKILL: {:?}",
        e.took
    );
    let pid: u32 = read(&dir.path().join("pid")).trim().parse().unwrap();
    assert!(!launcher::alive(pid), "CMD {pid} still running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_signals_reach_cmd_and_its_status_is_passed_on() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    // SIGTERM: CMD's handler runs and its exit code is ours.
    let script = format!(
        "trap 'exit 42' TERM; touch {}; while :; do sleep 0.05; done",
        ready.display()
    );
    let started = Instant::now();
    let child = lock_cmd(&dev.api, &["svc", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    wait_for_file(&ready).await;
    signal(child.id().unwrap(), libc::SIGTERM);
    let e = finish(child, started).await;
    assert_eq!(e.code, Some(42), "{}", e.stderr);
    assert_free(&dev.api, "svc").await;
    // SIGINT to a CMD without a handler: killed by it, so 128 + 2.
    let started = Instant::now();
    let child = lock_cmd(&dev.api, &["svc", "--", "sleep", "30"])
        .spawn()
        .unwrap();
    wait_until("CMD holds svc", Duration::from_secs(20), || {
        std::process::Command::new("curl")
            .args(["-sf", &format!("{}/v1/locks/svc", dev.api)])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    signal(child.id().unwrap(), libc::SIGINT);
    let e = finish(child, started).await;
    assert_eq!(e.code, Some(130), "{}", e.stderr);
    assert!(e.took < Duration::from_secs(20));
    assert_free(&dev.api, "svc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_cmd_not_found_127_not_executable_126_and_the_key_released() {
    let dev = Dev::start();
    let e = run_lock(&dev.api, &["k", "--", "/nonexistent/fencer-test-cmd"]).await;
    assert_eq!(e.code, Some(127), "{}", e.stderr);
    assert!(
        e.stderr.contains("cannot run /nonexistent/fencer-test-cmd"),
        "{}",
        e.stderr
    );
    assert_free(&dev.api, "k").await;
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("not-executable");
    std::fs::write(&plain, "#!/bin/sh\nexit 0\n").unwrap();
    let e = run_lock(&dev.api, &["k", "--", plain.to_str().unwrap()]).await;
    assert_eq!(e.code, Some(126), "{}", e.stderr);
    assert_free(&dev.api, "k").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_64_and_an_absent_sidecar_69() {
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    for args in [
        &["k"][..],                            // no CMD
        &["k", "true"],                        // CMD without `--`
        &["k", "--ttl", "soon", "--", "true"], // not a duration
        &["k", "--ttl", "10ms", "--", "true"], // below the sidecar's minimum
        &["k", "--wait", "1d", "--", "true"],  // unknown unit
        &["k", "--grace", "-1", "--", "true"],
        &["k", "--frobnicate", "--", "true"],
    ] {
        let e = run_lock(&nowhere, args).await;
        assert_eq!(e.code, Some(64), "{args:?}: {}", e.stderr);
        assert!(!e.stderr.is_empty(), "{args:?}");
    }
    let e = run_lock("https://127.0.0.1:1", &["k", "--", "true"]).await;
    assert_eq!(e.code, Some(64), "{}", e.stderr);
    let e = run_lock(&nowhere, &["k", "--", "true"]).await;
    assert_eq!(e.code, Some(69), "{}", e.stderr);
    assert!(
        e.stderr
            .starts_with("fencer lock: cannot reach the sidecar at http://127.0.0.1:"),
        "{}",
        e.stderr
    );
    // A key the sidecar refuses (400) is the caller's mistake too.
    let dev = Dev::start();
    let e = run_lock(&dev.api, &["bad\u{7}key", "--", "true"]).await;
    assert_eq!(e.code, Some(64), "{}", e.stderr);
    assert!(e.stderr.contains("invalid_request"), "{}", e.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_killed_while_cmd_runs_stops_cmd() {
    let mut dev = Dev::start();
    let cmd = LongCmd::start(&dev.api, &["job", "--grace", "1s"]).await;
    let killed = Instant::now();
    dev.child.kill().unwrap();
    cmd.assert_stopped_as_lost(killed, "job", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_silent_past_the_ttl_counts_as_lost() {
    let dev = Dev::start();
    let cmd = LongCmd::start(&dev.api, &["job", "--ttl", "2s"]).await;
    // Frozen, not dead: the connection stays open but nothing comes.
    let paused = Instant::now();
    signal(dev.child.id(), libc::SIGSTOP);
    cmd.assert_stopped_as_lost(paused, "job", "no word from the sidecar for 2000ms")
        .await;
    signal(dev.child.id(), libc::SIGCONT);
}

// ---------------------------------------------------------------- Redis

fn redis_sidecar(redis: &RedisServer) -> Fencer {
    Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[("sidecar.hold_heartbeat_ms", "200")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_runs_cmd_with_the_lease_and_releases_on_exit() {
    let redis = RedisServer::start(Persistence::Off);
    let sidecar = redis_sidecar(&redis);
    let dir = tempfile::tempdir().unwrap();
    let env_file = dir.path().join("env");
    let script = format!(
        "echo \"$FENCER_KEY|$FENCER_TOKEN|$FENCER_LEASE\" > {}; exit 3",
        env_file.display()
    );
    let e = run_lock(
        &sidecar.api,
        &["nightly", "--wait", "0", "--", "sh", "-c", &script],
    )
    .await;
    assert_eq!(e.code, Some(3), "{}", e.stderr);
    let env = read(&env_file);
    assert!(env.starts_with("nightly|"), "{env}");
    let first: u64 = env.split('|').nth(1).unwrap().parse().unwrap();
    assert_free(&sidecar.api, "nightly").await;
    // The next holder's token is higher: the one CMD saw was real.
    let e = run_lock(&sidecar.api, &["nightly", "--", "sh", "-c", &script]).await;
    assert_eq!(e.code, Some(3), "{}", e.stderr);
    let second: u64 = read(&env_file).split('|').nth(1).unwrap().parse().unwrap();
    assert!(second > first + 1, "{first} then {second}");
    // Held by another client: 75.
    let held = acquire(&sidecar.api, "nightly", 0).await;
    assert_eq!(held.status, 200);
    let e = run_lock(&sidecar.api, &["nightly", "--wait", "0", "--", "true"]).await;
    assert_eq!(e.code, Some(75), "{}", e.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lock_key_deleted_in_redis_means_lost_and_70() {
    let redis = RedisServer::start(Persistence::Off);
    let sidecar = redis_sidecar(&redis);
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let term = dir.path().join("term");
    let script = format!(
        "trap 'echo got-term > {}; exit 143' TERM; touch {}; while :; do sleep 0.05; done",
        term.display(),
        ready.display()
    );
    let child = lock_cmd(
        &sidecar.api,
        &["etl", "--ttl", "1500ms", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    wait_for_file(&ready).await;
    let mut conn = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*:lock").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let deleted_at = Instant::now();
    let _: () = redis::cmd("DEL").arg(&keys).query(&mut conn).unwrap();
    let e = finish(child, deleted_at).await;
    assert_eq!(e.code, Some(70), "{}", e.stderr);
    assert!(e.stderr.contains("lease on etl lost ("), "{}", e.stderr);
    assert_eq!(read(&term).trim(), "got-term");
    assert!(e.took < Duration::from_secs(5), "{:?}", e.took);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_past_the_ttl_means_lost_and_70() {
    let redis = RedisServer::start(Persistence::Off);
    let sidecar = redis_sidecar(&redis);
    let cmd = LongCmd::start(&sidecar.api, &["etl", "--ttl", "1s"]).await;
    let paused = Instant::now();
    redis.pause();
    cmd.assert_stopped_as_lost(paused, "etl", "sidecar reported")
        .await;
    redis.resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_lock_killed_frees_the_key_and_cmd_gets_sigterm() {
    let dev = Dev::start();
    let mut cmd = LongCmd::start(&dev.api, &["job"]).await;
    cmd.child.kill().await.unwrap();
    wait_until("CMD gone with its parent", Duration::from_secs(5), || {
        !launcher::alive(cmd.pid)
    });
    // The sidecar saw the connection close.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = acquire(&dev.api, "job", 0).await;
        if r.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "job still held: {}", r.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_api_runs_cmd_and_releases() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &[("sidecar.listen_unix", sock.to_str().unwrap())],
    );
    let api = format!("unix:{}", sock.display());
    let e = run_lock(
        &api,
        &[
            "uds",
            "--",
            "sh",
            "-c",
            "test -n \"$FENCER_LEASE\" && exit 5",
        ],
    )
    .await;
    assert_eq!(e.code, Some(5), "{}", e.stderr);
    // The same lock table behind the TCP listener: free after the return.
    assert_free(&sidecar.api, "uds").await;
    let held = acquire(&sidecar.api, "uds", 0).await;
    assert_eq!(held.status, 200);
    let e = run_lock(&api, &["uds", "--wait", "0", "--", "true"]).await;
    assert_eq!(e.code, Some(75), "{}", e.stderr);
}
