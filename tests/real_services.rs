//! docs/real-services.md, run as written: storage, gateway and sidecar from
//! `config/local/` against a real Redis and PostgreSQL, then the fencing
//! story with `curl` — so the page cannot rot. Only ports and the key
//! directory are substituted (the page says which). Also: every connection
//! error names the address it tried, and the gateway's keys and routes come
//! from the environment.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::launcher::ServerProcess;
use common::postgres::PgServer;
use common::{
    fencer_bin, free_port, http_ok, send, sign_v1, Backend, Fencer, Persistence, RedisServer,
    SECRET,
};

const DOC: &str = "docs/real-services.md";

/// The SQL of the page's step 1 (`sudo -u postgres psql -c … -c …`).
const CREATE_ROLE: &str = "CREATE ROLE fencer LOGIN PASSWORD 'fencer'";
const CREATE_DB: &str = "CREATE DATABASE fencer OWNER fencer";

/// The ports the page and config/local/ use; each is replaced (written as
/// `127.0.0.1:PORT`) by the test's own.
const PORTS: [u16; 8] = [6379, 5432, 7411, 7412, 8080, 8081, 9411, 9412];
const KEY_DIR: &str = "/tmp/fencer-local";

/// One block of the page marked `<!-- real-services:KIND [NAME] -->`.
#[derive(Debug)]
struct Block {
    kind: String,
    name: String,
    body: String,
}

/// Every marked block, in page order. A marker must be followed (after
/// blank lines) by a fenced block.
fn marked_blocks(doc: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let Some(marker) = line
            .trim()
            .strip_prefix("<!-- real-services:")
            .and_then(|m| m.strip_suffix("-->"))
        else {
            continue;
        };
        let mut words = marker.split_whitespace();
        let kind = words.next().expect("a marker names its kind").to_owned();
        let name = words.next().unwrap_or_default().to_owned();
        let fence = lines
            .by_ref()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "marker `{marker}` is not followed by a fenced block"
        );
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        blocks.push(Block {
            kind,
            name,
            body: body.join("\n") + "\n",
        });
    }
    blocks
}

/// Replaces the page's ports and key directory by the test's.
struct Subst {
    ports: HashMap<u16, u16>,
    key_dir: String,
}

impl Subst {
    fn apply(&self, text: &str) -> String {
        let mut out = text.replace(KEY_DIR, &self.key_dir);
        for (from, to) in &self.ports {
            out = out.replace(&format!("127.0.0.1:{from}"), &format!("127.0.0.1:{to}"));
        }
        out
    }

    fn port(&self, page_port: u16) -> u16 {
        self.ports[&page_port]
    }
}

/// `expected` with `...` matching anything, the whole line.
fn line_matches(expected: &str, actual: &str) -> bool {
    let pattern = expected
        .split("...")
        .map(regex::escape)
        .collect::<Vec<_>>()
        .join(".*");
    regex::Regex::new(&format!("^{pattern}$"))
        .unwrap()
        .is_match(actual)
}

fn strip_ansi(text: &str) -> String {
    regex::Regex::new("\x1b\\[[0-9;]*m")
        .unwrap()
        .replace_all(text, "")
        .into_owned()
}

/// Runs `script` with `sh` in `dir`, the binary under test first on PATH;
/// its stdout, or a panic with both streams after `timeout`.
fn run_sh(script: &str, dir: &Path, bin_dir: &Path, timeout: Duration) -> String {
    let out_path = dir.join("steps.out");
    let err_path = dir.join("steps.err");
    let mut child = sh(script, dir, bin_dir)
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "script did not finish within {timeout:?}:\n{script}\nstdout:\n{}\nstderr:\n{}",
                std::fs::read_to_string(&out_path).unwrap_or_default(),
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(status.success(), "{status}:\n{script}\nstderr:\n{err}");
    std::fs::read_to_string(&out_path).unwrap()
}

fn sh(script: &str, dir: &Path, bin_dir: &Path) -> Command {
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .current_dir(dir)
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    // The page's processes read only their files: no test settings leak in.
    for (k, _) in std::env::vars() {
        if k.starts_with("FENCER_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Copies config/local/ into `dir`, substituted.
fn copy_local_configs(dir: &Path, subst: &Subst) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/local");
    let dst = dir.join("config/local");
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(dst.join(path.file_name().unwrap()), subst.apply(&text)).unwrap();
    }
}

/// The page's commands, as written (ports and key directory aside),
/// against this test's Redis and PostgreSQL: 200 for the writes under a
/// held lease, 409 `lease_lost` at the proxy and 409
/// `stale_fencing_token` at the gateway for the stalled client.
#[test]
fn the_real_services_page_works_as_written() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(DOC)).unwrap();
    let blocks = marked_blocks(&doc);
    for b in &blocks {
        assert!(
            !b.body.contains("localhost"),
            "a marked block names `localhost`, which the test cannot move to its own ports:\n{}",
            b.body
        );
    }
    let of = |kind: &'static str| blocks.iter().filter(move |b| b.kind == kind);
    let prints: String = of("prints").map(|b| b.body.as_str()).collect();
    // What the page promises, whatever else it says.
    for promise in [
        r#"{"error":"lease_lost""#,
        r#"{"error":"stale_fencing_token""#,
    ] {
        assert!(
            prints
                .lines()
                .any(|l| l.starts_with(promise) && l.ends_with(" 409")),
            "the page no longer shows {promise} … 409:\n{prints}"
        );
    }
    assert!(prints.lines().any(|l| l.ends_with(" 200")), "{prints}");
    for kind in ["setup", "serve", "step", "prints", "log"] {
        assert!(of(kind).count() > 0, "no `real-services:{kind}` block");
    }

    let redis = RedisServer::start(Persistence::Off);
    let pg = PgServer::start();
    let psql = Command::new("psql")
        .arg(pg.url())
        .args(["-v", "ON_ERROR_STOP=1", "-c", CREATE_ROLE, "-c", CREATE_DB])
        .output()
        .expect("psql must be installed (apt-get install postgresql)");
    assert!(psql.status.success(), "{psql:?}");

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut ports: HashMap<u16, u16> = PORTS.iter().map(|&p| (p, free_port())).collect();
    ports.insert(6379, redis.port);
    ports.insert(5432, url::Url::parse(&pg.url()).unwrap().port().unwrap());
    let subst = Subst {
        ports,
        key_dir: dir.join("fencer-local").display().to_string(),
    };
    copy_local_configs(dir, &subst);
    let bin = PathBuf::from(fencer_bin());
    let bin_dir = bin.parent().unwrap();
    assert_eq!(bin.file_name().unwrap(), "fencer");

    for b in of("setup") {
        run_sh(&subst.apply(&b.body), dir, bin_dir, Duration::from_secs(30));
    }

    // Each served process as in a terminal of its own, ready before the next.
    let mut serving: Vec<(String, ServerProcess)> = Vec::new();
    for b in of("serve") {
        let ready_url = match b.name.as_str() {
            "storage" => format!("http://127.0.0.1:{}/healthz", subst.port(8081)),
            "gateway" => format!("http://127.0.0.1:{}/readyz", subst.port(9412)),
            "sidecar" => format!("http://127.0.0.1:{}/readyz", subst.port(9411)),
            other => panic!("the page serves `{other}`: teach this test how to see it ready"),
        };
        let mut process = ServerProcess::new(
            format!("{} (docs)", b.name),
            dir.join(format!("{}.log", b.name)),
        )
        .family();
        if let Err(e) = process.start(
            sh(&subst.apply(&b.body), dir, bin_dir),
            Duration::from_secs(60),
            Duration::from_millis(50),
            || http_ok(&ready_url),
        ) {
            panic!("{e}");
        }
        serving.push((b.name.clone(), process));
    }

    // What each process prints, as the page shows it.
    for b in of("log") {
        let (_, process) = serving
            .iter()
            .find(|(name, _)| *name == b.name)
            .unwrap_or_else(|| panic!("log of `{}`, which the page does not serve", b.name));
        for expected in subst.apply(&b.body).lines() {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let logs = strip_ansi(&process.logs());
                if logs.lines().any(|l| line_matches(expected, l)) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{} never printed\n{expected}\nits log:\n{logs}",
                    b.name
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    // The steps, typed into one terminal.
    let script: String = of("step").map(|b| subst.apply(&b.body)).collect();
    let out = run_sh(&script, dir, bin_dir, Duration::from_secs(60));
    let expected: Vec<String> = subst.apply(&prints).lines().map(str::to_owned).collect();
    let actual: Vec<&str> = out.lines().collect();
    let logs = || {
        serving
            .iter()
            .map(|(n, p)| format!("--- {n}\n{}", strip_ansi(&p.log_tail(20))))
            .collect::<String>()
    };
    assert_eq!(
        actual.len(),
        expected.len(),
        "the steps printed\n{out}\nthe page shows\n{}\n{}",
        expected.join("\n"),
        logs()
    );
    for (e, a) in expected.iter().zip(&actual) {
        assert!(
            line_matches(e, a),
            "the page shows\n{e}\nthe steps printed\n{a}\n(all of it:\n{out})\n{}",
            logs()
        );
    }

    // README says its quick-start walkthrough runs unchanged against this
    // stack (same ports as `fencer dev`): run it too, on another account
    // (the page's B still holds account:1), with the ports moved.
    let mut walk = fencer::dev::WALKTHROUGH
        .replace("account:1", "account:7")
        .replace("accounts/1", "accounts/7");
    for port in [7411u16, 7412, 8080, 8081] {
        walk = walk.replace(
            &format!("localhost:{port}/"),
            &format!("127.0.0.1:{}/", subst.port(port)),
        );
    }
    let out = run_sh(&walk, dir, bin_dir, Duration::from_secs(60));
    let answers: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{out}")))
        .collect();
    assert_eq!(
        answers.len(),
        7,
        "README's walkthrough printed\n{out}\n{}",
        logs()
    );
    assert_eq!(answers[4]["error"], "lease_lost", "{out}");
    assert_eq!(answers[5]["error"], "stale_fencing_token", "{out}");
    assert_eq!(answers[6]["value"]["balance"], 200, "{out}");
}

/// config/local/ passes check-config once the page's signing key exists
/// (check-config reads every secret file a role reads; the key is moved
/// to a temporary directory so the test does not depend on /tmp state).
#[test]
fn local_configs_pass_check_config() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/local");
    let keys = tempfile::tempdir().unwrap();
    let k1 = keys.path().join("k1");
    std::fs::write(&k1, "0123456789abcdef0123456789abcdef0123456789abcdef\n").unwrap();
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let out = Command::new(fencer_bin())
            .arg("--config")
            .arg(&path)
            .arg("check-config")
            // The role each file is for: its name (the key variables
            // below would otherwise make storage.toml look like a gateway's).
            .args(["--role", path.file_stem().unwrap().to_str().unwrap()])
            .env("FENCER__SIGNING__SECRET_FILE", &k1)
            .env("FENCER__GATEWAY__KEYS_DIR", keys.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        n += 1;
    }
    assert_eq!(n, 3, "sidecar, gateway and storage");
}

/// The address a connection error names (`127.0.0.1:PORT`).
fn addr(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// `r` is the refusal `expected` and its message names `address`.
fn assert_refused_naming(r: &common::Resp, expected: (u16, &str), address: &str) {
    assert_eq!((r.status, r.code()), expected, "{}", r.body);
    let message = r.body["message"].as_str().unwrap_or_default();
    assert!(message.contains(address), "{address} not named: {message}");
    assert!(!message.contains("pw@"), "password shown: {message}");
}

/// A sidecar whose Redis, PostgreSQL, MySQL or ZooKeeper is not there says which address it
/// tried, in `/readyz` and in the 503 of an acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_names_the_backend_address_it_could_not_reach() {
    let closed = free_port();
    let zk_connect = addr(closed);
    for (backend, url, extra) in [
        (
            Backend::Redis,
            format!("redis://127.0.0.1:{closed}/0"),
            None,
        ),
        (
            Backend::Postgres,
            format!("postgres://fencer:pw@127.0.0.1:{closed}/fencer"),
            None,
        ),
        (
            Backend::MySql,
            format!("mysql://fencer:pw@127.0.0.1:{closed}/fencer"),
            None,
        ),
        (
            Backend::ZooKeeper,
            String::new(),
            Some(("backend.zookeeper.connect", zk_connect.as_str())),
        ),
    ] {
        let extra: Vec<(&str, &str)> = extra.into_iter().collect();
        let sidecar = Fencer::sidecar(backend, Some(&url), &extra);
        let ready = send(
            &sidecar.http,
            "GET",
            &format!("{}/readyz", sidecar.admin),
            &[],
            None,
        )
        .await;
        assert_eq!(ready.status, 503, "{}", ready.body);
        let message = ready.body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&addr(closed)),
            "{}: /readyz does not name the address: {message}",
            backend.name()
        );
        let r = sidecar.acquire("k", 5_000, 0).await;
        assert_refused_naming(&r, (503, "backend_unavailable"), &addr(closed));
    }
}

/// A gateway whose fence store is not there names it while it retries,
/// and its upstream and a sidecar's gateway are named when they refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_hops_name_the_address_they_could_not_reach() {
    let closed = free_port();
    let dir = tempfile::tempdir().unwrap();
    for store in ["postgres", "mysql"] {
        let log = dir.path().join(format!("gateway-{store}.log"));
        let mut gateway = ServerProcess::new(format!("gateway (closed {store})"), &log);
        let mut cmd = Command::new(fencer_bin());
        cmd.arg("gateway")
            .env("FENCER__GATEWAY__FENCE_STORE", store)
            .env(
                format!("FENCER__GATEWAY__{}_URL", store.to_uppercase()),
                format!("{store}://fencer:pw@127.0.0.1:{closed}/fencer"),
            )
            .env("FENCER__GATEWAY__LISTEN", addr(free_port()))
            .env("FENCER__ADMIN__LISTEN", addr(free_port()))
            .env("FENCER__SIGNING__SECRET_ENV", "FENCER_TEST_SECRET")
            .env("FENCER_TEST_SECRET", SECRET)
            .env("FENCER__LOG__FORMAT", "json");
        gateway.spawn(cmd);
        let named = common::eventually(Duration::from_secs(20), || {
            gateway
                .logs()
                .lines()
                .any(|l| l.contains("fence store not ready") && l.contains(&addr(closed)))
        })
        .await;
        assert!(
            named,
            "{store}: no retry line naming {}:\n{}",
            addr(closed),
            gateway.logs()
        );
        assert!(!gateway.logs().contains("pw@"), "password shown");
        gateway.kill();
    }

    // Gateway -> storage.
    let gw = Fencer::gateway(&format!("http://{}", addr(closed)), &[]);
    let r = send(
        &gw.http,
        "PUT",
        &format!("{}/kv/a", gw.api),
        &[
            ("Fencing-Key", "a"),
            ("Fencing-Token", &sign_v1("a", 1, "l1")),
        ],
        Some("{}"),
    )
    .await;
    assert_refused_naming(&r, (502, "upstream_error"), &addr(closed));

    // Sidecar -> gateway: pre-registration, then the proxy.
    let redis = RedisServer::start(Persistence::Off);
    let prereg = format!("http://{}/_fencer/v1/fences/", addr(closed));
    let sidecar = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[("sidecar.preregister_url", &prereg)],
    );
    let r = sidecar.acquire("k", 5_000, 0).await;
    assert_refused_naming(&r, (503, "gateway_unavailable"), &addr(closed));
    let upstream = format!("http://{}", addr(closed));
    let sidecar = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[
            ("sidecar.preregister_url", ""),
            ("proxy.upstream", &upstream),
        ],
    );
    let lease = sidecar.acquire("k2", 5_000, 0).await.lease();
    let r = send(
        &sidecar.http,
        "PUT",
        &format!("{}/x", sidecar.proxy),
        &[("Fencing-Lock", "k2"), ("Fencing-Lease", &lease)],
        Some("{}"),
    )
    .await;
    assert_refused_naming(&r, (502, "upstream_error"), &addr(closed));
}

/// `FENCER__GATEWAY__KEYS`, `FENCER__GATEWAY__ROUTES` and
/// `FENCER__GATEWAY__KEYS_DIR` configure a gateway that has no file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_keys_and_routes_come_from_the_environment() {
    let storage = Fencer::storage(&[]);
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    std::fs::write(&good, format!("{SECRET}\n")).unwrap();
    let other = dir.path().join("other");
    std::fs::write(&other, "another-secret-0123456789-abcdefghijklmnop").unwrap();
    let keys_dir = dir.path().join("keys");
    std::fs::create_dir(&keys_dir).unwrap();
    std::fs::write(keys_dir.join("k1"), SECRET).unwrap();
    let routes = "/kv/accounts/{id}=account:{id}";

    let write = |gw: &Fencer, path: &str, key: &str, token: u64| {
        let (http, url) = (gw.http.clone(), format!("{}{path}", gw.api));
        let (key, signed) = (key.to_owned(), sign_v1(key, token, "l1"));
        async move {
            send(
                &http,
                "PUT",
                &url,
                &[("Fencing-Key", &key), ("Fencing-Token", &signed)],
                Some("{}"),
            )
            .await
        }
    };
    let good_path = good.display().to_string();
    let keys_path = keys_dir.display().to_string();
    let other_path = other.display().to_string();
    for (what, keys_var, keys) in [
        (
            "FENCER__GATEWAY__KEYS",
            "gateway.keys",
            format!("k1:{good_path}"),
        ),
        (
            "FENCER__GATEWAY__KEYS as JSON",
            "gateway.keys",
            format!(r#"[{{"key_id":"k1","secret_file":"{good_path}"}}]"#),
        ),
        (
            "FENCER__GATEWAY__KEYS_DIR",
            "gateway.keys_dir",
            keys_path.clone(),
        ),
    ] {
        let gw = Fencer::gateway(
            &storage.api,
            &[
                (keys_var, &keys),
                ("gateway.routes", routes),
                // The [signing] fallback would verify too: point it away.
                ("signing.secret_env", "FENCER_UNSET_SECRET_VARIABLE"),
            ],
        );
        let r = write(&gw, "/kv/accounts/7", "account:7", 1).await;
        assert_eq!(r.status, 200, "{what}: {}", r.body);
        let r = write(&gw, "/kv/elsewhere/7", "account:7", 2).await;
        assert_eq!(
            (r.status, r.code()),
            (403, "path_not_routed"),
            "{what}: {}",
            r.body
        );
    }
    // The variable replaces the [signing] key: a key of another secret
    // refuses tokens the signing secret made.
    let gw = Fencer::gateway(
        &storage.api,
        &[("gateway.keys", &format!("k1:{other_path}"))],
    );
    let r = write(&gw, "/kv/accounts/7", "account:7", 1).await;
    assert_eq!(
        (r.status, r.code()),
        (403, "invalid_fencing_token"),
        "{}",
        r.body
    );
}

/// A malformed list variable or key directory stops the process with exit
/// code 2 and names what to fix.
#[test]
fn malformed_key_and_route_settings_exit_2_naming_the_variable() {
    let check = |env: &[(&str, &str)], args: &[&str]| {
        let mut cmd = Command::new(fencer_bin());
        cmd.args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (var, value) in [
        ("FENCER__GATEWAY__KEYS", "k1"),
        ("FENCER__GATEWAY__KEYS", r#"[{"key_id":"k1","secret":"x"}]"#),
        ("FENCER__GATEWAY__ROUTES", "accounts=account"),
        ("FENCER__PROXY__ROUTES", "/kv/{id}"),
    ] {
        let (code, err) = check(&[(var, value)], &["check-config"]);
        assert_eq!(code, Some(2), "{var}={value}: {err}");
        assert!(err.contains(var), "{var}={value}: {err}");
    }
    // A bad route template is refused as one from the file would be.
    let (code, err) = check(
        &[("FENCER__GATEWAY__ROUTES", "/kv/{id}=account:{other}")],
        &["check-config"],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("gateway.routes"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("k1.bak"), SECRET).unwrap();
    let keys_dir = dir.path().display().to_string();
    let (code, err) = check(
        &[
            ("FENCER__GATEWAY__KEYS_DIR", &keys_dir),
            ("FENCER__GATEWAY__FENCE_STORE", "memory"),
            ("FENCER__GATEWAY__LISTEN", &addr(free_port())),
            ("FENCER__ADMIN__LISTEN", &addr(free_port())),
        ],
        &["gateway"],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("gateway.keys_dir") && err.contains("k1.bak"),
        "{err}"
    );
}
