//! `fencer check-config`: the files a role reads, the effective settings as
//! redacted TOML that loads back, the nearest name for a typo, and
//! `--live` against real Redis and PostgreSQL (issue 30 item 4).

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::shared::PgDb;
use common::upstream::Recorder;
use common::{make_certs, Persistence, RedisServer};

const SECRET: &str = "0123456789abcdef0123456789abcdef";

/// `fencer ARGS` with exactly `env` of the `FENCER` variables.
fn fencer(args: &[&str], env: &[(&str, &str)]) -> Output {
    let bin = std::env::var("FENCER_TEST_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_fencer").to_owned());
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("FENCER")) {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// `check-config` of `toml` (written to a file) with `extra` arguments.
fn check(toml: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fencer.toml");
    std::fs::write(&path, toml).unwrap();
    let mut args = vec!["--config", path.to_str().unwrap(), "check-config"];
    args.extend(extra);
    fencer(&args, env)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn path_in(dir: &Path, name: &str) -> String {
    dir.join(name).to_str().unwrap().to_owned()
}

/// The issue's case: a secret file that is not there passed (exit 0) and
/// the real start then exited 2. Now exit 2 naming the field and the file,
/// for the sidecar's signing secret and the gateway's keys.
#[test]
fn a_missing_secret_file_exits_2_naming_field_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = path_in(dir.path(), "k1");
    let sidecar = format!("[backend]\nkind = \"memory\"\n[signing]\nsecret_file = \"{missing}\"\n");
    let out = check(&sidecar, &[], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("signing.secret_file") && err.contains(&missing),
        "{err}"
    );
    // The real start agrees (what check-config promises).
    let start = fencer(
        &["sidecar"],
        &[
            ("FENCER__BACKEND__KIND", "memory"),
            ("FENCER__SIGNING__SECRET_FILE", &missing),
            ("FENCER__SIDECAR__LISTEN", "127.0.0.1:0"),
            ("FENCER__PROXY__LISTEN", "127.0.0.1:0"),
            ("FENCER__ADMIN__LISTEN", "127.0.0.1:0"),
        ],
    );
    assert_eq!(start.status.code(), Some(2), "{}", stderr(&start));

    let gateway = format!(
        "[gateway]\nfence_store = \"memory\"\n[[gateway.keys]]\nkey_id = \"k1\"\nsecret_file = \"{missing}\"\n"
    );
    let out = check(&gateway, &[], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("gateway.keys.secret_file") && err.contains(&missing),
        "{err}"
    );
    // Created (long enough): accepted.
    std::fs::write(&missing, SECRET).unwrap();
    let out = check(&gateway, &[], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Too short: named with its file.
    std::fs::write(&missing, "short\n").unwrap();
    let out = check(&gateway, &[], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(&missing) && stderr(&out).contains("32 bytes"),
        "{}",
        stderr(&out)
    );
    // `--no-files` (a manifest checked where its mounts are not) skips them.
    std::fs::remove_file(&missing).unwrap();
    let out = check(&gateway, &["--no-files"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Unreadable: a directory where a file should be (the tests run as root,
/// where `chmod 000` reads fine), and `chmod 000` when not root. Every
/// failure is reported, not only the first.
#[test]
fn an_unreadable_secret_or_ca_exits_2_with_every_failure() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let toml = format!(
        "[backend]\nkind = \"redis\"\n[backend.redis]\nca_file = \"{d}\"\n[signing]\nsecret_file = \"{d}\"\n"
    );
    let out = check(&toml, &[], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("backend.redis.ca_file"), "{err}");
    assert!(err.contains("signing.secret_file"), "{err}");
    assert!(err.contains("2 configuration error(s)"), "{err}");
    if unsafe { libc::geteuid() } != 0 {
        let file = path_in(dir.path(), "ca.pem");
        std::fs::write(&file, "x").unwrap();
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o000))
            .unwrap();
        let out = check(
            &format!("[backend]\nkind = \"redis\"\n[backend.redis]\nca_file = \"{file}\"\n"),
            &[],
            &[],
        );
        assert_eq!(out.status.code(), Some(2));
        assert!(stderr(&out).contains(&file), "{}", stderr(&out));
    }
}

/// A CA that is not PEM, or a PEM block that is not a certificate, exits 2;
/// a real CA passes (for each backend that takes one).
#[test]
fn a_bad_pem_ca_exits_2_and_a_real_one_passes() {
    let certs = make_certs();
    let dir = tempfile::tempdir().unwrap();
    let junk = path_in(dir.path(), "junk.pem");
    std::fs::write(&junk, "this is not a certificate\n").unwrap();
    let fake = path_in(dir.path(), "fake.pem");
    std::fs::write(
        &fake,
        "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let ca = certs.path().join("ca.crt").to_str().unwrap().to_owned();
    for (kind, section) in [
        ("redis", "backend.redis"),
        ("postgres", "backend.postgres"),
        ("mysql", "backend.mysql"),
    ] {
        for bad in [&junk, &fake] {
            let toml = format!("[backend]\nkind = \"{kind}\"\n[{section}]\nca_file = \"{bad}\"\n");
            let out = check(&toml, &[], &[]);
            assert_eq!(out.status.code(), Some(2), "{kind} {bad}: {}", stderr(&out));
            let err = stderr(&out);
            assert!(
                err.contains(&format!("{section}.ca_file")) && err.contains(bad.as_str()),
                "{err}"
            );
        }
        let toml = format!("[backend]\nkind = \"{kind}\"\n[{section}]\nca_file = \"{ca}\"\n");
        let out = check(&toml, &[], &[]);
        assert!(out.status.success(), "{kind}: {}", stderr(&out));
    }
    // The gateway's PostgreSQL CA.
    let gw = format!(
        "[gateway]\nfence_store = \"postgres\"\npostgres_url = \"postgres://f@db/f\"\npostgres_ca_file = \"{junk}\"\n[signing]\nsecret_env = \"S\"\n"
    );
    let out = check(&gw, &[], &[("S", SECRET)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("gateway.postgres_ca_file"));
    // The injector's pair: the certificate and a key that matches it.
    let (crt, key) = (
        certs.path().join("server.crt"),
        certs.path().join("server.key"),
    );
    let inject = |c: &Path, k: &str| {
        format!(
            "[inject]\ntls_cert_file = \"{}\"\ntls_key_file = \"{k}\"\n",
            c.display()
        )
    };
    let out = check(&inject(&crt, key.to_str().unwrap()), &[], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("for the inject role"),
        "{}",
        stdout(&out)
    );
    let out = check(&inject(&crt, &junk), &[], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("inject.tls_key_file"),
        "{}",
        stderr(&out)
    );
}

/// The body of a `check-config` output: its TOML without the comments,
/// which name the role and the variables.
fn body(out: &str) -> String {
    out.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split("  # FENCER__").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The output is TOML; loaded back as a configuration file it gives the
/// same settings (printed again: the same TOML); values a variable set
/// carry its name; passwords never appear.
#[test]
fn the_output_is_toml_that_loads_back_with_variables_marked_and_passwords_hidden() {
    let toml = "[backend]\nkind = \"redis\"\n[backend.redis]\nrequest_timeout_ms = 900\n[[proxy.routes]]\npath = \"/kv/{id}\"\nkey = \"kv:{id}\"\n";
    let env = [
        ("FENCER__BACKEND__REDIS__URL", "redis://:hunter2@r:6379/0"),
        ("FENCER__SIDECAR__DEFAULT_TTL_MS", "7000"),
        ("FENCER__BACKEND__POSTGRES__URL", "postgres://u:pgpw@db/x"),
        ("FENCER__SIGNING__SECRET_ENV", "S"),
        ("S", SECRET),
    ];
    let out = check(toml, &[], &env);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with("# configuration ok for the sidecar role (backend.kind is set)"),
        "{text}"
    );
    for secret in ["hunter2", "pgpw", SECRET] {
        assert!(!text.contains(secret), "{secret} printed:\n{text}");
    }
    assert!(
        text.contains("url = \"redis://:REDACTED@r:6379/0\"  # FENCER__BACKEND__REDIS__URL\n"),
        "{text}"
    );
    assert!(
        text.contains("default_ttl_ms = 7000  # FENCER__SIDECAR__DEFAULT_TTL_MS\n"),
        "{text}"
    );
    assert!(text.contains("request_timeout_ms = 900\n"), "{text}");
    // Only what a sidecar reads: its backend, not the others, no injector.
    assert!(!text.contains("[backend.postgres]"), "{text}");
    assert!(!text.contains("[inject]"), "{text}");
    assert!(!text.contains("fence_store"), "{text}");
    let parsed: toml::Table = text.parse().expect("the output is TOML");
    assert_eq!(parsed["sidecar"]["default_ttl_ms"].as_integer(), Some(7000));
    // Round trip: load the output as the file, with no variables but the
    // secret's, and print it again.
    let again = check(&text, &[], &[("S", SECRET)]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(body(&stdout(&again)), body(&text));
    assert!(!stdout(&again).contains("# FENCER__"), "{}", stdout(&again));
}

/// A typo gets the nearest known field, from the file and from a variable,
/// in any section (nested and top level); the real start says the same.
#[test]
fn an_unknown_field_suggests_the_nearest_known_one() {
    let out = check("[sidecar]\ndefualt_ttl_ms = 5000\n", &[], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(
            "unknown field \"defualt_ttl_ms\" in [sidecar]; did you mean \"default_ttl_ms\"?"
        ),
        "{}",
        stderr(&out)
    );
    let out = check("[backend.redis]\nrequest_timout_ms = 5\n", &[], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("in [backend.redis]; did you mean \"request_timeout_ms\"?"),
        "{}",
        stderr(&out)
    );
    let out = fencer(
        &["check-config"],
        &[("FENCER__SIDECAR__DEFAULT_TLL_MS", "5000")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(
            "unknown field \"default_tll_ms\" in [sidecar] (set by FENCER__SIDECAR__DEFAULT_TLL_MS); did you mean \"default_ttl_ms\" (FENCER__SIDECAR__DEFAULT_TTL_MS)?"
        ),
        "{}",
        stderr(&out)
    );
    let out = fencer(&["check-config"], &[("FENCER__SIDCAR__LISTEN", "x")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("did you mean \"sidecar\""),
        "{}",
        stderr(&out)
    );
    let out = fencer(&["sidecar"], &[("FENCER__LOG__LEVLE", "debug")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("did you mean \"level\""),
        "{}",
        stderr(&out)
    );
}

/// Every shipped example passes for its role, with the files it names
/// created in a temporary directory and pointed at by variables.
#[test]
fn every_shipped_config_passes_with_its_files_in_place() {
    let certs = make_certs();
    let dir = tempfile::tempdir().unwrap();
    let secret = path_in(dir.path(), "k1");
    std::fs::write(&secret, SECRET).unwrap();
    let crt = certs.path().join("server.crt");
    let key = certs.path().join("server.key");
    let signing = [("FENCER__SIGNING__SECRET_FILE", secret.as_str())];
    // Only for the injector's file: a variable naming `[inject]` counts
    // for the role inference like the section in the file.
    let inject = [
        ("FENCER__INJECT__TLS_CERT_FILE", crt.to_str().unwrap()),
        ("FENCER__INJECT__TLS_KEY_FILE", key.to_str().unwrap()),
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let secret_line = regex::Regex::new(r#"(?m)^secret_file = ".*"$"#).unwrap();
    let mut roles = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // A gateway's keys name their files: point each at the secret.
        let text = secret_line
            .replace_all(&text, format!("secret_file = \"{secret}\""))
            .into_owned();
        let files: &[(&str, &str)] = if text.contains("[inject]") {
            &inject
        } else {
            &signing
        };
        let out = check(&text, &[], files);
        assert!(out.status.success(), "{}: {}", path.display(), stderr(&out));
        let first = stdout(&out).lines().next().unwrap_or_default().to_owned();
        roles.push(first);
    }
    let roles = roles.join("\n");
    for role in ["sidecar", "gateway", "inject", "storage"] {
        assert!(
            roles.contains(&format!("for the {role} role")),
            "no {role} example checked as one:\n{roles}"
        );
    }
}

/// `--live` against a real Redis (sidecar) and PostgreSQL (gateway fence
/// store), each with an HTTP upstream: every row ok, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_checks_pass_against_real_redis_and_postgres() {
    let redis = RedisServer::start(Persistence::Off);
    let upstream = Recorder::start().await;
    let pg = PgDb::shared();
    // The sidecar's gateway: a real one, whose fence API must answer.
    let gw = common::Fencer::gateway(&upstream.url(), &[]);
    let gw_url = format!("http://127.0.0.1:{}", gw.api_port);
    let (redis_url, up, pg_url) = (redis.url(), upstream.url(), pg.url());
    let out = tokio::task::spawn_blocking(move || {
        let sidecar = fencer(
            &["check-config", "--live"],
            &[
                ("FENCER__BACKEND__KIND", "redis"),
                ("FENCER__BACKEND__REDIS__URL", &redis_url),
                ("FENCER__PROXY__UPSTREAM", &gw_url),
                (
                    "FENCER__SIDECAR__PREREGISTER_URL",
                    &format!("{gw_url}/_fencer/v1/fences/"),
                ),
            ],
        );
        // Something answers there, but not a gateway's fence API.
        let not_a_gateway = fencer(
            &["check-config", "--live"],
            &[
                ("FENCER__BACKEND__KIND", "memory"),
                ("FENCER__PROXY__UPSTREAM", &up),
                (
                    "FENCER__SIDECAR__PREREGISTER_URL",
                    &format!("{up}/_fencer/v1/fences/"),
                ),
            ],
        );
        let table = stdout(&not_a_gateway);
        assert_eq!(not_a_gateway.status.code(), Some(1), "{table}");
        let failed: Vec<&str> = table.lines().filter(|l| l.contains("FAIL")).collect();
        assert_eq!(failed.len(), 1, "{table}");
        assert!(failed[0].contains("not a fencer gateway"), "{table}");
        let gateway = fencer(
            &["check-config", "--live", "--role", "gateway"],
            &[
                ("FENCER__GATEWAY__FENCE_STORE", "postgres"),
                ("FENCER__GATEWAY__POSTGRES_URL", &pg_url),
                ("FENCER__GATEWAY__UPSTREAM", &up),
                ("FENCER__SIGNING__SECRET_ENV", "S"),
                ("S", SECRET),
            ],
        );
        (sidecar, gateway)
    })
    .await
    .unwrap();
    let (sidecar, gateway) = out;
    let table = stdout(&sidecar);
    assert_eq!(
        sidecar.status.code(),
        Some(0),
        "{table}{}",
        stderr(&sidecar)
    );
    assert!(table.starts_with("CHECK"), "{table}");
    assert!(
        table.contains("lock backend") && table.contains(&format!("127.0.0.1:{}", redis.port)),
        "{table}"
    );
    assert!(table.contains("proxy upstream"), "{table}");
    assert!(table.contains("405 method_not_allowed"), "{table}");
    assert!(!table.contains("FAIL"), "{table}");
    let table = stdout(&gateway);
    assert_eq!(
        gateway.status.code(),
        Some(0),
        "{table}{}",
        stderr(&gateway)
    );
    assert!(
        table.contains("fence store") && table.contains("gateway upstream"),
        "{table}"
    );
    assert!(!table.contains("FAIL"), "{table}");
}

/// `--live` against closed ports: exit 1, each failed row naming the
/// address it tried, within the 5 s bound per check.
#[test]
fn live_checks_against_a_closed_port_fail_naming_the_address() {
    let closed = common::free_port();
    let redis = format!("redis://127.0.0.1:{closed}/0");
    let gateway = format!("http://127.0.0.1:{closed}");
    let prereg = format!("http://127.0.0.1:{closed}/_fencer/v1/fences/");
    let started = std::time::Instant::now();
    let out = fencer(
        &["check-config", "--live"],
        &[
            ("FENCER__BACKEND__KIND", "redis"),
            ("FENCER__BACKEND__REDIS__URL", &redis),
            ("FENCER__PROXY__UPSTREAM", &gateway),
            ("FENCER__SIDECAR__PREREGISTER_URL", &prereg),
        ],
    );
    let table = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{table}{}", stderr(&out));
    assert!(started.elapsed() < std::time::Duration::from_secs(15));
    let failed: Vec<&str> = table.lines().filter(|l| l.contains("FAIL")).collect();
    assert_eq!(failed.len(), 3, "{table}");
    for line in failed {
        assert!(line.contains(&format!("127.0.0.1:{closed}")), "{line}");
    }
    assert!(
        stderr(&out).contains("3 of 3 live checks failed"),
        "{}",
        stderr(&out)
    );
}

/// TLS settings of the upstream links and the gateway's listener (issue
/// 31 item 4): a missing CA file, a client certificate without its key,
/// TLS settings on an `http://` upstream, a gateway certificate that is
/// not there — each exit 2 naming the field; and the real start agrees.
#[test]
fn tls_settings_of_upstreams_and_the_gateway_listener_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let missing = path_in(dir.path(), "ca.pem");
    let cases = [
        (
            format!("[proxy]\nupstream = \"https://gw:8443\"\n[proxy.upstream_tls]\nca_file = \"{missing}\"\n"),
            "proxy.upstream_tls",
            missing.as_str(),
        ),
        (
            "[proxy]\nupstream = \"https://gw:8443\"\n[proxy.upstream_tls]\nclient_cert_file = \"/c.pem\"\n".to_owned(),
            "proxy.upstream_tls",
            "client_key_file",
        ),
        (
            format!("[proxy]\nupstream = \"http://gw:8080\"\n[proxy.upstream_tls]\nca_file = \"{missing}\"\n"),
            "proxy.upstream_tls",
            "not https://",
        ),
        (
            format!("[sidecar]\npreregister_url = \"https://gw:8443/_fencer/v1/fences/\"\n[sidecar.preregister_tls]\nca_file = \"{missing}\"\n"),
            "sidecar.preregister_tls",
            missing.as_str(),
        ),
    ];
    for (body, field, detail) in &cases {
        let toml = format!("[backend]\nkind = \"memory\"\n{body}");
        let out = check(&toml, &[], &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{toml}\n{err}");
        assert!(err.contains(field) && err.contains(detail), "{toml}\n{err}");
    }
    let gw = format!(
        "[gateway]\nfence_store = \"memory\"\nupstream = \"https://storage:8443\"\ntls_cert_file = \"{missing}\"\ntls_key_file = \"{missing}\"\n[gateway.upstream_tls]\nserver_name = \"storage.internal\"\n[signing]\nsecret_env = \"S\"\n"
    );
    let out = check(&gw, &[], &[("S", SECRET)]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("gateway.tls_cert_file") && err.contains(&missing),
        "{err}"
    );
    // The real start agrees.
    let start = fencer(
        &["sidecar"],
        &[
            ("FENCER__BACKEND__KIND", "memory"),
            ("FENCER__PROXY__UPSTREAM", "https://gw:8443"),
            ("FENCER__PROXY__UPSTREAM_TLS__CA_FILE", &missing),
            ("FENCER__SIDECAR__LISTEN", "127.0.0.1:0"),
            ("FENCER__PROXY__LISTEN", "127.0.0.1:0"),
            ("FENCER__ADMIN__LISTEN", "127.0.0.1:0"),
        ],
    );
    assert_eq!(start.status.code(), Some(2), "{}", stderr(&start));
    assert!(stderr(&start).contains(&missing), "{}", stderr(&start));
}

/// `[tracing]` (issue 31 item 3): accepted and printed for the roles that
/// trace, off (no endpoint printed) by default; the standard
/// `OTEL_EXPORTER_OTLP_ENDPOINT` shows as the effective endpoint; a bad
/// endpoint or ratio exits 2 naming the field.
#[test]
fn tracing_settings_are_checked_and_printed() {
    let secret = [("FENCER__SIGNING__SECRET_ENV", "S"), ("S", SECRET)];
    let toml = "[backend]\nkind = \"memory\"\n[tracing]\notlp_endpoint = \"http://collector:4318\"\nsampling_ratio = 0.25\nservice_name = \"orders-sidecar\"\n";
    let out = check(toml, &[], &secret);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let parsed: toml::Table = text.parse().expect("the output is TOML");
    let t = &parsed["tracing"];
    assert_eq!(
        t["otlp_endpoint"].as_str(),
        Some("http://collector:4318"),
        "{text}"
    );
    assert_eq!(t["sampling_ratio"].as_float(), Some(0.25));
    assert_eq!(t["service_name"].as_str(), Some("orders-sidecar"));
    assert_eq!(t["max_queue_size"].as_integer(), Some(2048));

    // Off by default: the section is printed, with no endpoint.
    let out = fencer(&["check-config"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let parsed: toml::Table = stdout(&out).parse().unwrap();
    assert!(
        parsed["tracing"].get("otlp_endpoint").is_none(),
        "{}",
        stdout(&out)
    );

    let mut env = secret.to_vec();
    env.push(("OTEL_EXPORTER_OTLP_ENDPOINT", "http://agent:4318"));
    let out = check("[backend]\nkind = \"memory\"\n", &[], &env);
    assert!(out.status.success(), "{}", stderr(&out));
    let parsed: toml::Table = stdout(&out).parse().unwrap();
    assert_eq!(
        parsed["tracing"]["otlp_endpoint"].as_str(),
        Some("http://agent:4318")
    );

    for (bad, field) in [
        (
            "otlp_endpoint = \"grpc://collector:4317\"",
            "tracing.otlp_endpoint",
        ),
        ("sampling_ratio = 1.5", "tracing.sampling_ratio"),
        ("max_queue_size = 0", "tracing.max_queue_size"),
    ] {
        let out = check(&format!("[tracing]\n{bad}\n"), &[], &secret);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stdout(&out));
        assert!(stderr(&out).contains(field), "{bad}: {}", stderr(&out));
    }
}

/// `backend.kind = "etcd"` (issue 34): `--live` reaches the members and
/// names them; a dead member list fails naming its address; a password
/// file that is not there is an error (exit 2) only when files are read.
#[test]
fn etcd_backend_settings_are_checked_and_reached_live() {
    let etcd = common::etcd::EtcdCluster::with_size(1);
    let endpoints = etcd.endpoints().join(",");
    let ok = fencer(
        &["check-config", "--live"],
        &[
            ("FENCER__BACKEND__KIND", "etcd"),
            ("FENCER__BACKEND__ETCD__ENDPOINTS", &endpoints),
        ],
    );
    let table = stdout(&ok);
    let lock_row = table
        .lines()
        .find(|l| l.contains("lock backend"))
        .unwrap_or("");
    assert!(
        lock_row.contains(&endpoints) && !lock_row.contains("FAIL"),
        "{table}{}",
        stderr(&ok)
    );
    let closed = format!("http://127.0.0.1:{}", common::free_port());
    let dead = fencer(
        &["check-config", "--live"],
        &[
            ("FENCER__BACKEND__KIND", "etcd"),
            ("FENCER__BACKEND__ETCD__ENDPOINTS", &closed),
        ],
    );
    let table = stdout(&dead);
    assert_eq!(dead.status.code(), Some(1), "{table}{}", stderr(&dead));
    let lock_row = table
        .lines()
        .find(|l| l.contains("lock backend"))
        .unwrap_or("");
    assert!(
        lock_row.contains("FAIL") && lock_row.contains(&closed),
        "{table}"
    );
    let pw = [
        ("FENCER__BACKEND__KIND", "etcd"),
        ("FENCER__BACKEND__ETCD__ENDPOINTS", endpoints.as_str()),
        ("FENCER__BACKEND__ETCD__USER", "fencer"),
        (
            "FENCER__BACKEND__ETCD__PASSWORD_FILE",
            "/nonexistent/etcd-pw",
        ),
    ];
    let files = fencer(&["check-config"], &pw);
    assert_eq!(files.status.code(), Some(2), "{}", stderr(&files));
    assert!(
        stderr(&files).contains("backend.etcd.password_file"),
        "{}",
        stderr(&files)
    );
    let no_files = fencer(&["check-config", "--no-files"], &pw);
    assert_eq!(no_files.status.code(), Some(0), "{}", stderr(&no_files));
    let missing = fencer(&["check-config"], &[("FENCER__BACKEND__KIND", "etcd")]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        stderr(&missing).contains("backend.etcd.endpoints"),
        "{}",
        stderr(&missing)
    );
}
