//! Configuration loading: precedence, validation, exit codes.

use std::path::Path;
use std::process::{Command, Output};

fn fencer(args: &[&str], env: &[(&str, &str)]) -> Output {
    // FENCER_TEST_BIN: an older build, to watch a test fail on it.
    let bin = std::env::var("FENCER_TEST_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_fencer").to_owned());
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn check_file(contents: &str, env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fencer.toml");
    std::fs::write(&path, contents).unwrap();
    fencer(&["--config", path.to_str().unwrap(), "check-config"], env)
}

/// A signing secret of the minimum length, for a gateway's checks.
const SECRET: &str = "0123456789abcdef0123456789abcdef";

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn shipped_example_configs_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            // secret_file points at a mounted path, not here: `--no-files`
            // (tests/check_config.rs checks them with their files in place).
            let out = fencer(
                &[
                    "--config",
                    path.to_str().unwrap(),
                    "check-config",
                    "--no-files",
                ],
                &[],
            );
            assert!(out.status.success(), "{}: {}", path.display(), stderr(&out));
            n += 1;
        }
    }
    assert!(n >= 2);
}

#[test]
fn unknown_backend_names_field_and_allowed_values() {
    let out = check_file("[backend]\nkind = \"consul\"\n", &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("kind") && err.contains("memory") && err.contains("redis"),
        "{err}"
    );
}

#[test]
fn unknown_field_is_rejected() {
    let out = check_file("[sidecar]\ndefault_tll_ms = 5\n", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("default_tll_ms"), "{}", stderr(&out));
}

#[test]
fn out_of_range_value_names_the_field() {
    let out = check_file("[sidecar]\ndefault_ttl_ms = 5\n", &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("sidecar.default_ttl_ms") && err.contains("100"),
        "{err}"
    );

    let out = check_file(
        "[backend]\nkind = \"redis\"\n[backend.redis]\nurl = \"http://x\"\n",
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("backend.redis.url"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn environment_overrides_file_which_overrides_defaults() {
    let out = check_file(
        "[sidecar]\ndefault_ttl_ms = 5000\ndefault_wait_ms = 10\n",
        &[("FENCER__SIDECAR__DEFAULT_TTL_MS", "7000")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("default_ttl_ms = 7000  # FENCER__SIDECAR__DEFAULT_TTL_MS\n"),
        "{text}"
    );
    assert!(text.contains("default_wait_ms = 10\n"), "{text}");
    assert!(text.contains("max_waiters = 10000\n"), "{text}");
}

#[test]
fn invalid_environment_value_exits_2() {
    let out = fencer(&["check-config"], &[("FENCER__SIDECAR__MAX_WAITERS", "0")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("sidecar.max_waiters"),
        "{}",
        stderr(&out)
    );
    let out = fencer(&["check-config"], &[("FENCER__LOG__FORMAT", "xml")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("json"), "{}", stderr(&out));
}

#[test]
fn missing_config_file_exits_2() {
    let out = fencer(
        &["--config", "/nonexistent/fencer.toml", "check-config"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("does not exist"));
}

#[test]
fn short_signing_secret_is_rejected_at_start() {
    let out = fencer(
        &["sidecar"],
        &[
            ("FENCER__SIGNING__SECRET_ENV", "FENCER_SHORT_SECRET"),
            ("FENCER_SHORT_SECRET", "short"),
            ("FENCER__BACKEND__KIND", "memory"),
            ("FENCER__SIDECAR__LISTEN", "127.0.0.1:0"),
            ("FENCER__ADMIN__LISTEN", "127.0.0.1:0"),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("signing.secret_env"),
        "{}",
        stderr(&out)
    );
}

/// Issue 9: outside `fencer dev`, a role must be told where its locks or
/// marks live; falling silently into the in-memory stores lost every
/// lock or mark on restart.
#[test]
fn sidecar_and_gateway_refuse_to_start_without_an_explicit_store() {
    let out = fencer(&["sidecar"], &[("FENCER__ADMIN__LISTEN", "127.0.0.1:0")]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("backend.kind"), "{}", stderr(&out));
    let out = fencer(
        &["gateway"],
        &[
            ("FENCER__SIGNING__SECRET_ENV", "S"),
            ("S", "0123456789abcdef0123456789abcdef"),
            ("FENCER__GATEWAY__LISTEN", "127.0.0.1:0"),
            ("FENCER__ADMIN__LISTEN", "127.0.0.1:0"),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("gateway.fence_store"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_key_id_listed_twice_is_refused() {
    let out = check_file(
        "[[gateway.keys]]\nkey_id = \"k1\"\nsecret_env = \"A\"\n[[gateway.keys]]\nkey_id = \"k1\"\nsecret_env = \"B\"\n",
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("listed twice"), "{}", stderr(&out));
}

/// The proxy must wait longer than the gateway may take; a sidecar that
/// gives up first lets its next request race the first (issue 9 item 1).
#[test]
fn a_proxy_timeout_below_the_gateways_budget_is_refused() {
    let out = check_file(
        "[backend]\nkind = \"redis\"\n[proxy]\nupstream_timeout_ms = 10000\n",
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("proxy.upstream_timeout_ms") && err.contains("16000"),
        "{err}"
    );
    // A gateway's file (no lock backend) is not held to the sidecar's rule.
    let gw = check_file(
        "[gateway]\nserialize_timeout_ms = 30000\nfence_store = \"memory\"\n[signing]\nsecret_env = \"S\"\n",
        &[("S", SECRET)],
    );
    assert!(gw.status.success(), "{}", stderr(&gw));
    let ok = check_file(
        "[backend]\nkind = \"redis\"\n[proxy]\nupstream_timeout_ms = 10000\n[gateway]\nupstream_timeout_ms = 3000\n",
        &[],
    );
    assert!(ok.status.success(), "{}", stderr(&ok));
    let pre = check_file(
        "[backend]\nkind = \"redis\"\n[sidecar]\npreregister_url = \"http://g:8080/_fencer/v1/fences/\"\npreregister_timeout_ms = 2000\n",
        &[],
    );
    assert_eq!(pre.status.code(), Some(2));
    assert!(
        stderr(&pre).contains("sidecar.preregister_timeout_ms"),
        "{}",
        stderr(&pre)
    );
}

#[test]
fn sentinel_mode_needs_sentinels_and_a_master_name() {
    let base = "[backend]\nkind = \"redis\"\n[backend.redis]\nmode = \"sentinel\"\n";
    let out = check_file(base, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("backend.redis.sentinels"),
        "{}",
        stderr(&out)
    );
    let out = check_file(&format!("{base}sentinels = [\"127.0.0.1:26379\"]\n"), &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("backend.redis.master_name"),
        "{}",
        stderr(&out)
    );
    let out = check_file(
        &format!("{base}sentinels = [\"127.0.0.1\"]\nmaster_name = \"m\"\n"),
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "a sentinel without a port");
    assert!(stderr(&out).contains("host:port"), "{}", stderr(&out));
    let out = check_file(
        &format!("{base}sentinels = [\"10.0.0.1:26379\", \"s2:26379\"]\nmaster_name = \"m\"\n"),
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn cluster_mode_needs_node_urls_on_database_0() {
    let base = "[backend]\nkind = \"redis\"\n[backend.redis]\nmode = \"cluster\"\n";
    let out = check_file(base, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("backend.redis.nodes"),
        "{}",
        stderr(&out)
    );
    let out = check_file(&format!("{base}nodes = [\"redis://n1:6379/2\"]\n"), &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("database 0"), "{}", stderr(&out));
    let out = check_file(&format!("{base}nodes = [\"http://n1:6379\"]\n"), &[]);
    assert_eq!(out.status.code(), Some(2));
    let out = check_file(
        &format!("{base}nodes = [\"redis://n1:6379\", \"rediss://n2:6380\"]\n"),
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn unknown_redis_mode_lists_the_allowed_ones() {
    let out = check_file("[backend.redis]\nmode = \"redlock\"\n", &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("single") && err.contains("sentinel") && err.contains("cluster"),
        "{err}"
    );
}

#[test]
fn wait_settings_are_bounded() {
    for (field, value) in [
        ("WAIT_REPLICAS", "65"),
        ("WAIT_TIMEOUT_MS", "0"),
        ("WAIT_TIMEOUT_MS", "10001"),
    ] {
        let var = format!("FENCER__BACKEND__REDIS__{field}");
        let out = fencer(&["check-config"], &[(var.as_str(), value)]);
        assert_eq!(out.status.code(), Some(2), "{field}={value}");
        assert!(
            stderr(&out).contains(&format!("backend.redis.{}", field.to_lowercase())),
            "{}",
            stderr(&out)
        );
    }
}

/// Sentinels and nodes are lists; an operator sets them per environment
/// as comma-separated values. Passwords in them never reach the output.
#[test]
fn topology_lists_come_from_the_environment_and_are_redacted() {
    let out = fencer(
        &["check-config"],
        &[
            ("FENCER__BACKEND__KIND", "redis"),
            ("FENCER__BACKEND__REDIS__MODE", "sentinel"),
            (
                "FENCER__BACKEND__REDIS__SENTINELS",
                "10.0.0.1:26379,10.0.0.2:26379",
            ),
            ("FENCER__BACKEND__REDIS__MASTER_NAME", "locks"),
            ("FENCER__BACKEND__REDIS__SENTINEL_PASSWORD", "hunter2"),
            (
                "FENCER__BACKEND__REDIS__NODES",
                "redis://:s3cret@n1:6379,redis://n2:6379",
            ),
            ("FENCER__BACKEND__REDIS__URL", "redis://:redispw@r:6379/0"),
            (
                "FENCER__BACKEND__POSTGRES__URL",
                "postgres://u:pgpw@db/fencer",
            ),
            (
                "FENCER__GATEWAY__POSTGRES_URL",
                "postgres://u:gwpw@db/fencer",
            ),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\"10.0.0.2:26379\""), "{text}");
    assert!(text.contains("redis://n2:6379"), "{text}");
    for secret in ["hunter2", "s3cret", "redispw", "pgpw", "gwpw"] {
        assert!(!text.contains(secret), "{secret} printed: {text}");
    }
}

/// RedLock needs an odd number (≥ 3) of distinct masters, and no lease may
/// outlive the restart quarantine that makes a master restarted empty safe.
#[test]
fn redlock_settings_are_checked_and_redacted() {
    let masters = "redis://:pw1@m1:6379,redis://m2:6379,redis://m3:6379";
    let base = [
        ("FENCER__BACKEND__KIND", "redlock"),
        ("FENCER__BACKEND__REDLOCK__URLS", masters),
    ];
    let out = fencer(&["check-config"], &base);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("m1:6379") && !text.contains("pw1"), "{text}");
    refused_each(
        &base,
        &[
            (
                "FENCER__BACKEND__REDLOCK__URLS",
                "redis://m1:6379,redis://m2:6379",
                "backend.redlock.urls",
            ),
            (
                "FENCER__BACKEND__REDLOCK__URLS",
                "redis://m1:6379,redis://m2:6379,redis://m1:6379",
                "backend.redlock.urls",
            ),
            (
                "FENCER__SIDECAR__DEFAULT_TTL_MS",
                "60001",
                "sidecar.default_ttl_ms",
            ),
            (
                "FENCER__BACKEND__REDLOCK__REQUEST_TIMEOUT_MS",
                "1001",
                "backend.redlock.request_timeout_ms",
            ),
        ],
    );
    // The quarantine off (appendfsync always on every master): any TTL.
    let mut env = base.to_vec();
    env.push(("FENCER__BACKEND__REDLOCK__RESTART_QUARANTINE_MS", "0"));
    env.push(("FENCER__SIDECAR__DEFAULT_TTL_MS", "600000"));
    let out = fencer(&["check-config"], &env);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn zookeeper_settings_are_checked_and_redacted() {
    let base = [
        ("FENCER__BACKEND__KIND", "zookeeper"),
        (
            "FENCER__BACKEND__ZOOKEEPER__CONNECT",
            "zk-0:2181,zk-1:2181,zk-2:2181",
        ),
        (
            "FENCER__BACKEND__ZOOKEEPER__AUTH_DIGEST",
            "fencer:s3cret-digest",
        ),
    ];
    let out = fencer(&["check-config"], &base);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("zk-1:2181") && !text.contains("s3cret-digest"),
        "{text}"
    );
    refused_each(
        &base,
        &[
            (
                "FENCER__BACKEND__ZOOKEEPER__CONNECT",
                "",
                "backend.zookeeper.connect",
            ),
            (
                "FENCER__BACKEND__ZOOKEEPER__CONNECT",
                "zk-0:2181/chroot",
                "backend.zookeeper.connect",
            ),
            (
                "FENCER__BACKEND__ZOOKEEPER__ROOT",
                "/zookeeper/fencer",
                "backend.zookeeper.root",
            ),
            // 45% of the default 30 s session is 13.5 s.
            (
                "FENCER__SIDECAR__DEFAULT_TTL_MS",
                "13501",
                "sidecar.default_ttl_ms",
            ),
            (
                "FENCER__BACKEND__ZOOKEEPER__SESSION_TIMEOUT_MS",
                "20000",
                "sidecar.default_ttl_ms",
            ),
            (
                "FENCER__SIDECAR__LOCK_DELAY_MS",
                "4000",
                "sidecar.default_ttl_ms",
            ),
            (
                "FENCER__BACKEND__ZOOKEEPER__REQUEST_TIMEOUT_MS",
                "10001",
                "backend.zookeeper.request_timeout_ms",
            ),
            (
                "FENCER__BACKEND__ZOOKEEPER__AUTH_DIGEST",
                "no-colon",
                "backend.zookeeper.auth_digest",
            ),
        ],
    );
}

/// A lock backend that can lose its token counter (tokens then start over
/// below the gateway's marks) without pre-registration, the one thing that
/// repairs it forward: `check-config` passes (exit 0) but warns on stderr —
/// for ZooKeeper (an ensemble rebuilt from empty), Redis `counter` tokens
/// and the in-process memory backend; not with `sidecar.preregister_url`
/// set, and not for backends whose tokens survive a lost counter
/// (PostgreSQL and MySQL rows, Redis and RedLock clock-floored tokens).
#[test]
fn check_config_warns_when_a_lost_counter_would_send_tokens_back() {
    let pre = "[sidecar]\npreregister_url = \"http://g:8080/_fencer/v1/fences/\"\n";
    let zk = "[backend]\nkind = \"zookeeper\"\n[backend.zookeeper]\nconnect = \"zk-0:2181\"\n";
    let redis_counter = "[backend]\nkind = \"redis\"\n[backend.redis]\ntoken_mode = \"counter\"\n";
    let memory = "[backend]\nkind = \"memory\"\n";
    for (name, file, warned) in [
        ("zookeeper", zk.to_owned(), true),
        ("redis counter", redis_counter.to_owned(), true),
        ("memory", memory.to_owned(), true),
        ("zookeeper + preregister", format!("{zk}{pre}"), false),
        ("redis counter + preregister", format!("{redis_counter}{pre}"), false),
        ("memory + preregister", format!("{memory}{pre}"), false),
        ("redis hybrid_clock", "[backend]\nkind = \"redis\"\n".to_owned(), false),
        (
            "redlock",
            "[backend]\nkind = \"redlock\"\n[backend.redlock]\nurls = [\"redis://a:6379\", \"redis://b:6379\", \"redis://c:6379\"]\n".to_owned(),
            false,
        ),
        (
            "postgres",
            "[backend]\nkind = \"postgres\"\n[backend.postgres]\nurl = \"postgres://u@db/fencer\"\n".to_owned(),
            false,
        ),
        (
            "mysql",
            "[backend]\nkind = \"mysql\"\n[backend.mysql]\nurl = \"mysql://u@db/fencer\"\n".to_owned(),
            false,
        ),
    ] {
        let out = check_file(&file, &[]);
        let err = stderr(&out);
        assert!(out.status.success(), "{name}: {err}");
        let warning = err
            .lines()
            .find(|l| l.starts_with("fencer: warning:") && l.contains("preregister_url"));
        assert_eq!(warning.is_some(), warned, "{name}: {err}");
        if let Some(w) = warning {
            assert!(w.contains("stale_fencing_token"), "{name}: {w}");
        }
    }
    // The environment form too (how the Helm chart configures sidecars).
    let out = fencer(
        &["check-config"],
        &[
            ("FENCER__BACKEND__KIND", "zookeeper"),
            ("FENCER__BACKEND__ZOOKEEPER__CONNECT", "zk-0:2181"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("fencer: warning: backend.kind = \"zookeeper\""),
        "{}",
        stderr(&out)
    );
}

/// Each `(variable, value, field)` on top of `base` makes `check-config`
/// exit 2 naming `field`.
fn refused_each(base: &[(&str, &str)], cases: &[(&str, &str, &str)]) {
    for (var, value, field) in cases {
        let mut env = base.to_vec();
        env.retain(|(k, _)| k != var);
        env.push((var, value));
        let out = fencer(&["check-config"], &env);
        assert_eq!(out.status.code(), Some(2), "{var}={value}");
        assert!(
            stderr(&out).contains(field),
            "{var}={value}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn gateway_mysql_settings_are_checked_and_redacted() {
    let base = [
        ("FENCER__GATEWAY__FENCE_STORE", "mysql"),
        (
            "FENCER__GATEWAY__MYSQL_URL",
            "mysql://fencer:s3cret-pw@db-0.example:3306/fencer",
        ),
        // A gateway needs its key (check-config checks it as the start does).
        ("FENCER__SIGNING__SECRET_ENV", "S"),
        ("S", SECRET),
    ];
    let out = fencer(&["check-config"], &base);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("db-0.example:3306") && !text.contains("s3cret-pw"),
        "{text}"
    );
    refused_each(
        &base,
        &[
            ("FENCER__GATEWAY__MYSQL_URL", "", "gateway.mysql_url"),
            (
                "FENCER__GATEWAY__MYSQL_URL",
                "postgres://fencer@db/fencer",
                "gateway.mysql_url",
            ),
            (
                "FENCER__GATEWAY__MYSQL_CA_FILE",
                "/nonexistent/ca.pem",
                "gateway.mysql_ca_file",
            ),
            (
                "FENCER__GATEWAY__MYSQL_POOL_SIZE",
                "0",
                "gateway.mysql_pool_size",
            ),
            (
                "FENCER__GATEWAY__MYSQL_REQUEST_TIMEOUT_MS",
                "5",
                "gateway.mysql_request_timeout_ms",
            ),
            // The demo storage has no MySQL engine.
            ("FENCER__STORAGE__BACKEND", "mysql", "storage.backend"),
        ],
    );
    // An unknown store lists mysql among the allowed ones.
    let out = fencer(
        &["check-config"],
        &[("FENCER__GATEWAY__FENCE_STORE", "mongo")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("mysql"), "{}", stderr(&out));
    // The PostgreSQL settings are untouched by a MySQL store and vice versa.
    let out = fencer(
        &["check-config"],
        &[
            ("FENCER__GATEWAY__FENCE_STORE", "postgres"),
            ("FENCER__GATEWAY__POSTGRES_URL", "postgres://f@db/f"),
            ("FENCER__GATEWAY__POSTGRES_REQUEST_TIMEOUT_MS", "3000"),
            ("FENCER__SIGNING__SECRET_ENV", "S"),
            ("S", SECRET),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn mysql_backend_settings_are_checked_and_redacted() {
    let base = [
        ("FENCER__BACKEND__KIND", "mysql"),
        (
            "FENCER__BACKEND__MYSQL__URL",
            "mysql://fencer:s3cret-pw@db:3306/fencer",
        ),
    ];
    let out = fencer(&["check-config"], &base);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("db:3306") && !text.contains("s3cret-pw"),
        "{text}"
    );
    refused_each(
        &base,
        &[
            (
                "FENCER__BACKEND__MYSQL__URL",
                "postgres://fencer@db/fencer",
                "backend.mysql.url",
            ),
            (
                "FENCER__BACKEND__MYSQL__CA_FILE",
                "/nonexistent/ca.pem",
                "backend.mysql.ca_file",
            ),
            (
                "FENCER__BACKEND__MYSQL__POOL_SIZE",
                "0",
                "backend.mysql.pool_size",
            ),
            (
                "FENCER__BACKEND__MYSQL__BELL_CONNECTIONS",
                "0",
                "backend.mysql.bell_connections",
            ),
            (
                "FENCER__BACKEND__MYSQL__REQUEST_TIMEOUT_MS",
                "99",
                "backend.mysql.request_timeout_ms",
            ),
            (
                "FENCER__BACKEND__MYSQL__IDLE_CLEANUP_AFTER_MS",
                "999",
                "backend.mysql.idle_cleanup_after_ms",
            ),
        ],
    );
}

#[test]
fn inject_settings_are_checked_and_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fencer.toml");
    std::fs::write(&path, "[inject]\nimage = \"fencer@sha256:00\"\n").unwrap();
    // Its certificate files are not here (tests/check_config.rs has them).
    let ok = fencer(
        &[
            "--config",
            path.to_str().unwrap(),
            "check-config",
            "--no-files",
        ],
        &[],
    );
    assert!(ok.status.success(), "{}", stderr(&ok));
    for (toml, field) in [
        ("[inject]\nimage = \"\"\n", "inject.image"),
        ("[inject]\nimage = \"fencer latest\"\n", "inject.image"),
        (
            "[inject]\nimage_pull_policy = \"Sometimes\"\n",
            "inject.image_pull_policy",
        ),
        (
            "[inject]\nconfig_map = \"Fencer_Config\"\n",
            "inject.config_map",
        ),
        (
            "[inject]\nsigning_secret = \"-bad\"\n",
            "inject.signing_secret",
        ),
        ("[inject]\nenv_secret = \"a..b\"\n", "inject.env_secret"),
        (
            "[inject]\nsigning_key_id = \"k/1\"\n",
            "inject.signing_key_id",
        ),
        (
            "[inject]\ngateway_url = \"gateway:8080\"\n",
            "inject.gateway_url",
        ),
        ("[inject]\nlock_api_port = 0\n", "inject.lock_api_port"),
        ("[inject]\nproxy_port = 7411\n", "inject.admin_port"),
        (
            "[inject]\nmemory_limit = \"256MB\"\n",
            "inject.memory_limit",
        ),
        (
            "[inject]\ncpu_request = \"2\"\ncpu_limit = \"1\"\n",
            "inject.cpu_request",
        ),
        ("[inject]\nrun_as_user = 0\n", "inject.run_as_user"),
        ("[inject]\nfail_open = true\n", "fail_open"),
    ] {
        let out = check_file(toml, &[]);
        assert_eq!(out.status.code(), Some(2), "{toml}");
        assert!(stderr(&out).contains(field), "{toml}: {}", stderr(&out));
    }
}
