//! Observability checked against a real Prometheus: every expression in the
//! Grafana dashboards and the alerting rules is evaluated against a
//! Prometheus that scraped a sidecar and a gateway under a workload with
//! contention, a lost lease, a stale write and a backend outage; each must
//! be valid and return series. Plus `promtool check metrics`, `check rules`
//! and `test rules`.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_prometheus(targets: &[(&str, u16)]) -> Prometheus {
    let dir = tempfile::tempdir().unwrap();
    let mut config = String::from(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n",
    );
    for (job, port) in targets {
        config.push_str(&format!(
            "  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        ));
    }
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let port = free_port();
    let child = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prometheus must be installed (tests/run.sh installs Debian's package)");
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http_ok(&format!("{url}/-/ready")) {
        assert!(Instant::now() < deadline, "prometheus did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    Prometheus {
        child,
        url,
        _dir: dir,
    }
}

async fn query(client: &reqwest::Client, prom: &str, expr: &str) -> Value {
    let q: String = url::form_urlencoded::byte_serialize(expr.as_bytes()).collect();
    client
        .get(format!("{prom}/api/v1/query?query={q}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Every `expr` in the dashboards, with Grafana's variables filled in.
fn dashboard_exprs() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root().join("grafana/dashboards")).unwrap() {
        let path = entry.unwrap().path();
        let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        fn walk(v: &Value, name: &str, out: &mut Vec<(String, String)>) {
            match v {
                Value::Object(m) => {
                    for (k, v) in m {
                        if k == "expr" {
                            out.push((name.to_owned(), v.as_str().unwrap().to_owned()));
                        } else {
                            walk(v, name, out);
                        }
                    }
                }
                Value::Array(a) => a.iter().for_each(|v| walk(v, name, out)),
                _ => {}
            }
        }
        walk(
            &dash,
            &path.file_name().unwrap().to_string_lossy(),
            &mut out,
        );
    }
    out.into_iter()
        .map(|(n, e)| {
            let e = e
                .replace("$__rate_interval", "1m")
                .replace("$namespace", ".*")
                .replace("$pod", ".*")
                .replace("$group", ".*");
            (n, e)
        })
        .collect()
}

/// Sends the injector a pod it injects and one it cannot (a misspelt
/// annotation), after Prometheus has scraped it once, so both counters rise.
async fn review_twice(injector: &Fencer, ca: &Path) {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap();
    fencer::pg::install_crypto_provider();
    let client = reqwest::Client::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let fixture = root().join("tests/fixtures/admission/deployment-pod.json");
    let good: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let mut bad = good.clone();
    bad["request"]["object"]["metadata"]["annotations"]["fencer.dev/memroy-limit"] = json!("1Gi");
    for review in [good, bad] {
        let r = client
            .post(format!("https://localhost:{}/mutate", injector.api_port))
            .json(&review)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
}

/// Every alert `expr` in the rules file (one line each).
fn rule_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(root().join("deploy/prometheus/fencer-rules.yaml")).unwrap();
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .map(|e| ("fencer-rules.yaml".to_owned(), e.trim().to_owned()))
        .collect()
}

async fn workload_round(s: &Fencer, g: &Fencer) {
    // Plain cycles.
    for _ in 0..10 {
        let r = s.acquire("acct:1", 5_000, 0).await;
        assert_eq!(r.status, 200);
        assert_eq!(s.renew("acct:1", &r.lease(), 5_000).await.status, 200);
        let w = send(
            &s.http,
            "PUT",
            &format!("{}/kv/acct/1", s.proxy),
            &[("Fencing-Lease", &r.lease())],
            Some("{}"),
        )
        .await;
        assert_eq!(w.status, 200, "{}", w.body);
        s.release("acct:1", &r.lease()).await;
    }
    // Contention in group "busy": one holder, waiters that time out and
    // one that is woken by the release.
    let holder = s.acquire("busy:1", 10_000, 0).await;
    for _ in 0..3 {
        assert_eq!(s.acquire("busy:1", 10_000, 50).await.code(), "lock_held");
    }
    let s_api = s.api.clone();
    let client = s.http.clone();
    let waiter = tokio::spawn(async move {
        send(
            &client,
            "POST",
            &format!("{s_api}/v1/locks/busy:1/acquire"),
            &[],
            Some(r#"{"wait_ms":5000}"#),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.release("busy:1", &holder.lease()).await;
    let w = waiter.await.unwrap();
    s.release("busy:1", w.body["lease_id"].as_str().unwrap())
        .await;
    // A lost lease and a stale write.
    let old = s.acquire("acct:9", 150, 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        s.get(&Fencer::path("acct:9", "")).await.body["state"],
        "lost"
    );
    let new = s.acquire("acct:9", 5_000, 0).await;
    assert_eq!(new.status, 200);
    let stale = send(
        &s.http,
        "PUT",
        &format!("{}/kv/acct/9", g.api),
        &[("Fencing-Token", old.body["fencing_token"].as_str().unwrap())],
        Some("{}"),
    )
    .await;
    assert_eq!(stale.code(), "stale_fencing_token");
    s.release("acct:9", &new.lease()).await;
    // Auto-renewal.
    let a = s
        .post(
            &Fencer::path("auto:1", "acquire"),
            json!({"ttl_ms": 300, "auto_renew": true}),
        )
        .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    s.release("auto:1", &a.lease()).await;
}

/// A few acquire/release cycles on a ZooKeeper (or MySQL) sidecar.
async fn zookeeper_round(zk: &Fencer) {
    for _ in 0..5 {
        let r = zk.acquire("acct:1", 5_000, 1_000).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(zk.release("acct:1", &r.lease()).await.status, 200);
    }
}

async fn redlock_round(rl: &Fencer) {
    for _ in 0..5 {
        let r = rl.acquire("acct:1", 5_000, 1_000).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(rl.release("acct:1", &r.lease()).await.status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboards_and_alerts_work_against_a_real_prometheus() {
    let mut redis = RedisServer::start(Persistence::Off);
    let storage = Fencer::storage(&[]);
    let g = Fencer::gateway(&storage.api, &[]);
    let pre = format!("{}/_fencer/v1/fences/", g.api);
    let s = Fencer::sidecar(
        Backend::Redis,
        Some(&redis.url()),
        &[
            ("proxy.upstream", g.api.as_str()),
            ("sidecar.preregister_url", pre.as_str()),
            ("backend.redis.request_timeout_ms", "200"),
        ],
    );
    // A RedLock sidecar too (3 masters), for the dashboard's RedLock row.
    let masters: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start(Persistence::Off))
        .collect();
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let urls = urls.join(",");
    let rl = Fencer::sidecar(
        Backend::RedLock,
        None,
        &[
            ("backend.redlock.urls", urls.as_str()),
            ("backend.redlock.restart_quarantine_ms", "0"),
        ],
    );
    // And a ZooKeeper sidecar, for the ZooKeeper row.
    let ensemble = common::zookeeper::ZooKeeperEnsemble::with_size(1);
    let zk = Fencer::sidecar(
        Backend::ZooKeeper,
        None,
        &[(
            "backend.zookeeper.connect",
            ensemble.connect_string().as_str(),
        )],
    );
    // And a MySQL sidecar, for the MySQL row.
    let db = common::mariadb::MariaDb::start();
    let my = Fencer::sidecar(Backend::MySql, Some(&db.url()), &[]);
    // And the injector, for the injection row: one pod injected, one that
    // asked with a misspelt annotation (failed open).
    let certs = make_certs();
    let cert = certs.path().join("server.crt");
    let key = certs.path().join("server.key");
    let injector = Fencer::injector(&[
        ("inject.tls_cert_file", cert.to_str().unwrap()),
        ("inject.tls_key_file", key.to_str().unwrap()),
    ]);
    let prom = start_prometheus(&[
        ("injector", injector.admin_port),
        ("sidecar-mysql", my.admin_port),
        ("sidecar", s.admin_port),
        ("gateway", g.admin_port),
        ("sidecar-redlock", rl.admin_port),
        ("sidecar-zookeeper", zk.admin_port),
    ]);
    let client = reqwest::Client::new();
    // Both targets scraped at least once before anything happens, so every
    // counter's increase is visible.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let up = query(&client, &prom.url, "sum(up)").await;
        if up["data"]["result"][0]["value"][1] == "6" {
            break;
        }
        assert!(Instant::now() < deadline, "targets not scraped: {up}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    review_twice(&injector, &certs.path().join("ca.crt")).await;
    workload_round(&s, &g).await;
    redlock_round(&rl).await;
    zookeeper_round(&zk).await;
    zookeeper_round(&my).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    workload_round(&s, &g).await;
    redlock_round(&rl).await;
    zookeeper_round(&zk).await;
    zookeeper_round(&my).await;
    // A backend outage: errors and a failed readiness ping.
    redis.kill();
    let r = s.acquire("acct:1", 5_000, 0).await;
    assert_eq!(r.code(), "backend_unavailable");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    while s.acquire("acct:2", 5_000, 0).await.status != 200 {
        assert!(Instant::now() < deadline, "no recovery");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(3_000)).await;

    let mut exprs = dashboard_exprs();
    let rules = rule_exprs();
    assert!(
        exprs.len() >= 20,
        "too few dashboard expressions: {}",
        exprs.len()
    );
    assert_eq!(rules.len(), 6);
    exprs.extend(rules);
    let mut failures = Vec::new();
    for (source, expr) in &exprs {
        let r = query(&client, &prom.url, expr).await;
        if r["status"] != "success" {
            failures.push(format!("{source}: INVALID {expr}: {}", r["error"]));
        } else if r["data"]["result"].as_array().is_none_or(|a| a.is_empty()) {
            failures.push(format!("{source}: NO SERIES {expr}"));
        }
    }
    eprintln!("{} expressions evaluated against Prometheus", exprs.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // promtool on both metric endpoints and on the rules.
    for admin in [&s.admin, &g.admin, &injector.admin] {
        let text = client
            .get(format!("{admin}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let mut child = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let rules_dir = root().join("deploy/prometheus");
    for args in [
        ["check", "rules", "fencer-rules.yaml"],
        ["test", "rules", "fencer-rules.test.yaml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(&rules_dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
