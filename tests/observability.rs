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
        .map(|(n, e)| (n, fill_variables(&e)))
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

/// A few acquire/release cycles on a ZooKeeper (or MySQL, or etcd) sidecar.
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

/// A validly signed token far above a key's mark (what a leaked secret
/// allows): the gateway counts a jump, and the sidecar's next acquire of
/// the key finds the mark above its token and does not repair that far
/// (pre-registration `stale`). Key `acct:jump`: group `acct` was scraped
/// already, so `increase()` sees both counters go from 0 to 1.
async fn token_jump(s: &Fencer, g: &Fencer) {
    let r = s.acquire("acct:jump", 5_000, 0).await;
    assert_eq!(r.status, 200, "{}", r.body);
    s.release("acct:jump", &r.lease()).await;
    let far = r.token() + (1 << 41);
    let w = send(
        &s.http,
        "PUT",
        &format!("{}/kv/acct/jump", g.api),
        &[("Fencing-Token", &sign_v1("acct:jump", far, "forged"))],
        Some("{}"),
    )
    .await;
    assert_eq!(w.status, 200, "{}", w.body);
    let again = s.acquire("acct:jump", 5_000, 0).await;
    assert_ne!(again.status, 200, "{}", again.body);
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
    // And an etcd sidecar, for the etcd row.
    let etcd_cluster = common::etcd::EtcdCluster::with_size(1);
    let etcd_endpoints = etcd_cluster.endpoints().join(",");
    let etcd = Fencer::sidecar(
        Backend::Etcd,
        None,
        &[("backend.etcd.endpoints", etcd_endpoints.as_str())],
    );
    // And a MySQL sidecar, for the MySQL row.
    let mut db = common::mariadb::MariaDb::start();
    let my = Fencer::sidecar(Backend::MySql, Some(&db.url()), &[]);
    // And a gateway on a MySQL fence store, for the fence-store-down stat
    // and alert (the database is killed at the end).
    let db_url = db.url();
    let gm = Fencer::gateway(
        &storage.api,
        &[
            ("gateway.fence_store", "mysql"),
            ("gateway.mysql_url", db_url.as_str()),
        ],
    );
    // And a gateway on a PostgreSQL fence store, for its group commit's
    // panel.
    let pg = common::postgres::PgServer::start();
    let pg_url = pg.url();
    let gp = Fencer::gateway(
        &storage.api,
        &[
            ("gateway.fence_store", "postgres"),
            ("gateway.postgres_url", pg_url.as_str()),
        ],
    );
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
        ("sidecar-etcd", etcd.admin_port),
        ("gateway-mysql", gm.admin_port),
        ("gateway-postgres", gp.admin_port),
    ]);
    let client = reqwest::Client::new();
    // Both targets scraped at least once before anything happens, so every
    // counter's increase is visible.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let up = query(&client, &prom.url, "sum(up)").await;
        if up["data"]["result"][0]["value"][1] == "9" {
            break;
        }
        assert!(Instant::now() < deadline, "targets not scraped: {up}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    review_twice(&injector, &certs.path().join("ca.crt")).await;
    // One Dapr call, for the Dapr panel (no store configured: refused,
    // and counted as such).
    let dapr = client
        .post(format!("{}/v1.0-alpha1/lock/orders", s.api))
        .json(&serde_json::json!({"resourceId": "r", "lockOwner": "o", "expiryInSeconds": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(dapr.status(), 400);
    workload_round(&s, &g).await;
    redlock_round(&rl).await;
    zookeeper_round(&zk).await;
    zookeeper_round(&my).await;
    zookeeper_round(&etcd).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    token_jump(&s, &g).await;
    workload_round(&s, &g).await;
    redlock_round(&rl).await;
    zookeeper_round(&zk).await;
    zookeeper_round(&my).await;
    zookeeper_round(&etcd).await;
    // A backend outage: errors and a failed readiness ping; and the MySQL
    // gateway's fence store gone for good.
    db.kill();
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
    assert_eq!(rules.len(), 9);
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

/// The dashboards, parsed, with their file names.
fn dashboards() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root().join("grafana/dashboards")).unwrap() {
        let path = entry.unwrap().path();
        let dash = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        out.push((
            path.file_name().unwrap().to_string_lossy().into_owned(),
            dash,
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The stat panels of a dashboard's top row, which must be titled
/// "Overview" and come first.
fn overview_stats(name: &str, dash: &Value) -> Vec<Value> {
    let panels = dash["panels"].as_array().unwrap();
    assert_eq!(panels[0]["type"], "row", "{name}: first panel is not a row");
    assert_eq!(panels[0]["title"], "Overview", "{name}");
    assert_eq!(panels[0]["collapsed"], false, "{name}: Overview collapsed");
    let stats: Vec<Value> = panels[1..]
        .iter()
        .take_while(|p| p["type"] != "row")
        .cloned()
        .collect();
    for p in &stats {
        assert_eq!(p["type"], "stat", "{name}: {} in the overview", p["title"]);
    }
    stats
}

/// Grafana's variables as "everything", as the live tests evaluate them.
fn fill_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$namespace", ".*")
        .replace("$pod", ".*")
        .replace("$group", ".*")
}

/// The unit a query computes, by its outermost function: latencies are
/// seconds, rates per second, increases and gauges plain counts.
fn unit_fits(panel_type: &str, expr: &str, unit: &str) -> bool {
    let e = expr.trim_start();
    if panel_type == "heatmap" {
        // A heatmap's unit is its buckets' bounds (le, in seconds).
        return unit == "s";
    }
    if e.starts_with("histogram_quantile") {
        return unit == "s";
    }
    if expr.contains("rate(") {
        return ["ops", "reqps", "percentunit"].contains(&unit);
    }
    if expr.contains("increase(") {
        return unit == "none";
    }
    ["none", "percentunit", "s", "bytes"].contains(&unit)
}

/// Every panel says its unit, and the unit matches what each of its
/// queries computes (a per-query override where they differ); the overview
/// row has stat panels with thresholds for what an on-call person needs;
/// the backend-specific rows are collapsed.
#[test]
fn dashboards_have_units_an_overview_and_collapsed_backend_rows() {
    let mut problems = Vec::new();
    for (name, dash) in dashboards() {
        let mut all = Vec::new();
        for p in dash["panels"].as_array().unwrap() {
            all.push(p.clone());
            if let Some(inner) = p["panels"].as_array() {
                all.extend(inner.iter().cloned());
            }
        }
        for p in all.iter().filter(|p| p["type"] != "row") {
            let title = p["title"].as_str().unwrap();
            let default = p["fieldConfig"]["defaults"]["unit"].as_str().unwrap_or("");
            for t in p["targets"].as_array().unwrap() {
                let refid = t["refId"].as_str().unwrap();
                let unit = p["fieldConfig"]["overrides"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|o| o["matcher"]["options"] == refid)
                    .and_then(|o| {
                        o["properties"]
                            .as_array()?
                            .iter()
                            .find(|p| p["id"] == "unit")?["value"]
                            .as_str()
                    })
                    .unwrap_or(default);
                let expr = t["expr"].as_str().unwrap();
                if !unit_fits(p["type"].as_str().unwrap(), expr, unit) {
                    problems.push(format!(
                        "{name}: {title} [{refid}] unit {unit:?} for {expr}"
                    ));
                }
            }
        }
        for stat in overview_stats(&name, &dash) {
            let title = stat["title"].as_str().unwrap();
            let steps = &stat["fieldConfig"]["defaults"]["thresholds"]["steps"];
            if steps.as_array().is_none_or(|s| s.is_empty()) {
                problems.push(format!("{name}: stat {title} has no thresholds"));
            }
        }
        // Rows after the first two (Overview, and the role's own panels)
        // are backend- or feature-specific: collapsed, their panels inside.
        let rows: Vec<&Value> = dash["panels"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["type"] == "row")
            .collect();
        assert!(rows.len() >= 2, "{name}: rows {}", rows.len());
        for row in &rows[2..] {
            if row["collapsed"] != true || row["panels"].as_array().is_none_or(|p| p.is_empty()) {
                problems.push(format!(
                    "{name}: row {} not collapsed with its panels",
                    row["title"]
                ));
            }
        }
        let top: Vec<&Value> = dash["panels"].as_array().unwrap().iter().collect();
        if let Some(first_collapsed) = top.iter().position(|p| p["collapsed"] == true) {
            for p in &top[first_collapsed..] {
                if p["type"] != "row" {
                    problems.push(format!(
                        "{name}: {} sits outside a collapsed row",
                        p["title"]
                    ));
                }
            }
        }
    }
    // The main dashboard's overview covers what the brief of issue 30 asks.
    let (_, main) = dashboards()
        .into_iter()
        .find(|(n, _)| n == "lock-contention.json")
        .unwrap();
    let exprs: Vec<String> = overview_stats("lock-contention.json", &main)
        .iter()
        .map(|p| p["targets"][0]["expr"].as_str().unwrap().to_owned())
        .collect();
    for needle in [
        "fencer_backend_up",
        "fencer_leases_held",
        "increase(fencer_lost_leases_total",
        "result=~\"stale|stale_sequence\"}[1h]",
        "fencer_gateway_fence_store_up",
        "role=~\"sidecar|dev\"",
        "role=~\"gateway|dev\"",
    ] {
        if !exprs.iter().any(|e| e.contains(needle)) {
            problems.push(format!(
                "lock-contention.json: no overview stat on {needle}"
            ));
        }
    }
    let backend_rows: Vec<String> = main["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] == "row" && p["collapsed"] == true)
        .map(|p| p["title"].as_str().unwrap().to_owned())
        .collect();
    for row in ["Redis topology", "RedLock", "ZooKeeper", "etcd", "MySQL"] {
        if !backend_rows.iter().any(|r| r == row) {
            problems.push(format!("lock-contention.json: no collapsed row {row}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every alert names its runbook, and the runbook has that section.
#[test]
fn every_alert_has_a_runbook_section() {
    let rules =
        std::fs::read_to_string(root().join("deploy/prometheus/fencer-rules.yaml")).unwrap();
    let runbooks = std::fs::read_to_string(root().join("docs/runbooks.md")).unwrap();
    let mut alerts = Vec::new();
    for line in rules.lines().map(str::trim) {
        if let Some(a) = line.strip_prefix("- alert:") {
            alerts.push((a.trim().to_owned(), None));
        } else if let Some(r) = line.strip_prefix("runbook:") {
            alerts.last_mut().expect("runbook before any alert").1 =
                Some(r.trim().trim_matches('"').to_owned());
        }
    }
    assert!(alerts.len() >= 9, "{alerts:?}");
    for (alert, runbook) in alerts {
        let want = format!("docs/runbooks.md#{}", alert.to_lowercase());
        assert_eq!(runbook.as_deref(), Some(want.as_str()), "{alert}");
        assert!(
            runbooks.lines().any(|l| l == format!("## {alert}")),
            "docs/runbooks.md has no section `## {alert}`"
        );
    }
}

/// A fresh `fencer dev` with no traffic at all: its /metrics already has
/// the counters of events that have not happened, at 0, and every overview
/// stat of every dashboard shows a value in Prometheus (0 events, 100% up),
/// not "No data".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_dev_shows_zeros_not_no_data() {
    let dev = common::dev::Dev::start();
    let client = reqwest::Client::new();
    let metrics = dev.metrics().await;
    let mut missing = Vec::new();
    for reason in fencer::metrics::sidecar::LOST_REASONS {
        missing.push(format!(
            "fencer_lost_leases_total{{group=\"other\",reason=\"{reason}\"}} 0"
        ));
    }
    for line in [
        "fencer_leases_held{group=\"other\"} 0",
        "fencer_acquisitions_total{group=\"other\",result=\"timeout\"} 0",
        "fencer_preregistrations_total{result=\"error\"} 0",
        "fencer_preregistrations_total{result=\"stale\"} 0",
        "fencer_gateway_requests_total{group=\"other\",kind=\"write\",result=\"stale\"} 0",
        "fencer_gateway_requests_total{group=\"other\",kind=\"write\",result=\"store_error\"} 0",
        "fencer_gateway_token_jumps_total{group=\"other\"} 0",
        "fencer_gateway_fence_store_up{store=\"memory\"} 1",
        "fencer_webhook_deliveries_total{result=\"failed\"} 0",
        "fencer_sql_abandoned_statements_total{db=\"postgres\"} 0",
    ] {
        missing.push(line.to_owned());
    }
    missing.retain(|line| !metrics.lines().any(|l| l == line));
    assert!(
        missing.is_empty(),
        "not in /metrics: {missing:?}\n{metrics}"
    );

    // Prometheus with three scrapes of it: enough for increase() over 1h.
    let prom = start_prometheus(&[("dev", dev.admin_port)]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = query(&client, &prom.url, "count_over_time(up[1h])").await;
        if n["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse::<u32>().ok())
            .is_some_and(|n| n >= 3)
        {
            break;
        }
        assert!(Instant::now() < deadline, "dev not scraped: {n}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut failures = Vec::new();
    let mut evaluated = 0;
    for (name, dash) in dashboards() {
        for stat in overview_stats(&name, &dash) {
            let title = stat["title"].as_str().unwrap();
            let expr = fill_variables(stat["targets"][0]["expr"].as_str().unwrap());
            let r = query(&client, &prom.url, &expr).await;
            evaluated += 1;
            let values: Vec<f64> = r["data"]["result"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| s["value"][1].as_str().unwrap().parse().unwrap())
                .collect();
            // Up and "up" shares read 1; counts of events and leases 0.
            let want = if title.ends_with(" up") { 1.0 } else { 0.0 };
            if values.is_empty() || values.iter().any(|v| *v != want) {
                failures.push(format!(
                    "{name}: {title}: {values:?}, want {want}: {expr} -> {r}"
                ));
            }
        }
    }
    assert!(evaluated >= 10, "{evaluated} overview stats");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
