//! `fencer dev`: the README's first command. One process, every role, one
//! metrics endpoint, and the fencing walkthrough works.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::dev::Dev;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_runs_every_role_behind_one_metrics_endpoint() {
    let (mut cmd, [api, proxy, gw, _st, admin]) = Dev::command();
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_ok(&format!("http://127.0.0.1:{admin}/readyz")) {
        assert!(Instant::now() < deadline, "fencer dev did not become ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let http = reqwest::Client::new();
    let lease = send(
        &http,
        "POST",
        &format!("http://127.0.0.1:{api}/v1/locks/account:1/acquire"),
        &[],
        Some("{}"),
    )
    .await;
    assert_eq!(lease.status, 200);
    let w = send(
        &http,
        "PUT",
        &format!("http://127.0.0.1:{proxy}/kv/accounts/1"),
        &[("Fencing-Lease", lease.body["lease_id"].as_str().unwrap())],
        Some(r#"{"balance":100}"#),
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let direct = send(
        &http,
        "PUT",
        &format!("http://127.0.0.1:{gw}/kv/accounts/1"),
        &[],
        Some("{}"),
    )
    .await;
    assert_eq!(direct.code(), "fencing_token_required");
    let metrics = http
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for needle in [
        "role=\"dev\"",
        "fencer_acquisitions_total",
        "fencer_proxy_requests_total{result=\"forwarded\"} 1",
        "fencer_gateway_requests_total",
        "fencer_preregistrations_total{result=\"ok\"} 1",
    ] {
        assert!(
            metrics.contains(needle),
            "missing {needle} in one scrape:\n{metrics}"
        );
    }
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

/// README's quick start between its `walkthrough` markers.
fn readme_walkthrough() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let begin = readme
        .find("<!-- walkthrough:begin -->\n```sh\n")
        .expect("README has a walkthrough:begin marker before a sh block");
    let rest = &readme[begin..];
    let body = &rest[rest.find("```sh\n").unwrap() + 6..];
    let end = body
        .find("```\n<!-- walkthrough:end -->")
        .expect("README's walkthrough block ends at walkthrough:end");
    body[..end].to_string()
}

/// The issue-30 promise: a person reading README gets from `fencer dev` to
/// a refused stale write by pasting what README shows — and `fencer dev`
/// prints that very text. The walkthrough is run as printed (with this
/// test's free ports) and its answers checked, so neither can rot.
#[test]
fn dev_prints_the_readme_walkthrough_and_it_ends_with_a_stale_write_refused() {
    let (mut cmd, ports) = Dev::command();
    let defaults = [7411, 7412, 8080, 8081, 9411];
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let printed = std::thread::spawn(move || {
        use std::io::Read;
        let mut out = String::new();
        let mut buf = [0u8; 4096];
        while !out.contains("Ctrl-C to stop.") {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        out
    })
    .join()
    .unwrap();
    let intro = "(needs curl and jq):\n\n";
    let start = printed
        .find(intro)
        .unwrap_or_else(|| panic!("no walkthrough in fencer dev's output:\n{printed}"))
        + intro.len();
    let end = printed.rfind("\nCtrl-C to stop.").unwrap();
    let shown = &printed[start..end];
    // Back to the default ports: then it must be README's text, byte for byte.
    let mut as_readme = shown.to_string();
    for (port, default) in ports.iter().zip(defaults) {
        as_readme = as_readme.replace(
            &format!("127.0.0.1:{port}/"),
            &format!("localhost:{default}/"),
        );
    }
    assert_eq!(
        as_readme,
        readme_walkthrough(),
        "fencer dev prints a walkthrough other than README's"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_ok(&format!("http://127.0.0.1:{}/readyz", ports[4])) {
        assert!(Instant::now() < deadline, "fencer dev did not become ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let run = Command::new("bash")
        .arg("-c")
        .arg(format!("set -u\n{shown}"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&run.stdout).to_string();
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let _ = child.wait();
    assert!(run.status.success(), "walkthrough failed: {run:?}");
    let lines: Vec<&str> = out.lines().collect();
    // A's acquire, A's write, B's acquire, B's write, A via the proxy,
    // A at the gateway, the storage.
    assert_eq!(lines.len(), 7, "one answer per command:\n{out}");
    let json = |i: usize| -> serde_json::Value {
        serde_json::from_str(lines[i]).unwrap_or_else(|e| panic!("line {i} {e}:\n{out}"))
    };
    let (a, b) = (json(0), json(2));
    assert!(
        b["token"].as_u64() > a["token"].as_u64(),
        "B's token is not above A's:\n{out}"
    );
    assert_eq!(json(4)["error"], "lease_lost", "{out}");
    assert_eq!(json(5)["error"], "stale_fencing_token", "{out}");
    assert_eq!(
        json(6)["value"]["balance"],
        200,
        "the storage lost B's write:\n{out}"
    );
}

/// The front page stays a front page (issue 30: at most 250 lines; the
/// manual lives in docs/), and every relative link in README, CONTRIBUTING
/// and docs/ names a file that exists.
#[test]
fn readme_is_short_and_every_relative_link_resolves() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let n = readme.lines().count();
    assert!(
        n <= 250,
        "README.md has {n} lines; the manual belongs in docs/"
    );
    let mut files = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let mut broken = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(j) = rest.find(')') else { break };
            let target = rest[..j].split('#').next().unwrap();
            rest = &rest[j..];
            if target.is_empty() || target.contains("://") || target.contains(' ') {
                continue;
            }
            if !f.parent().unwrap().join(target).exists() {
                broken.push(format!("{}: {target}", f.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to missing files:\n{}",
        broken.join("\n")
    );
}

/// `fencer demo` piped (a CI log, `| less`): its table on a clean screen —
/// no log lines from the stack it runs (each refused stale write is a
/// warning in production, ~76 of them buried the table) and no colour
/// codes.
#[test]
fn demo_prints_its_table_without_log_lines_or_colour_codes() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .args(["demo", "--seconds", "1", "--workers", "4"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for (name, text) in [("stdout", &stdout), ("stderr", &stderr)] {
        assert!(
            !text.contains('\x1b'),
            "colour codes on a piped {name}:\n{text}"
        );
    }
    let noise: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("running: "))
        .collect();
    assert!(noise.is_empty(), "log lines during the demo:\n{stderr}");
    assert!(stdout.contains("LOST UPDATES"), "no table:\n{stdout}");
}

/// `fencer --version` names the commit a bug report is about: in a git
/// checkout, the one checked out when the binary was built.
#[test]
fn version_names_the_git_commit() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencer"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let commit = head.unwrap_or_else(|| "unknown".into());
    assert_eq!(
        text,
        format!("fencer {} (commit {commit})", env!("CARGO_PKG_VERSION"))
    );
}
