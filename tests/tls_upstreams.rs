//! TLS on the upstream links (issue 31 item 4), with real processes: a
//! write goes app → proxy → gateway → storage over TLS with client
//! certificates on every hop, and each link refuses what it must: a server
//! from another CA, a certificate for another name, a client without a
//! certificate where one is required. Certificates are made with `openssl`
//! for each test.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use fencer::http::tls_client::UpstreamTls;
use serde_json::json;

/// A CA with a server certificate (localhost, 127.0.0.1) and a client
/// certificate, and a second, unrelated CA.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // P-256 keys: as good for the test as RSA, and made in milliseconds.
        let key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let (keyout, out, subj) = (
                format!("{ca}.key"),
                format!("{ca}.crt"),
                format!("/CN=fencer-test-{ca}"),
            );
            let mut args = vec!["req", "-x509"];
            args.extend(key);
            args.extend([
                "-keyout", &keyout, "-out", &out, "-subj", &subj, "-days", "2",
            ]);
            openssl(d, &args);
        }
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        std::fs::write(d.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for (name, cn) in [("server", "localhost"), ("client", "fencer-sidecar")] {
            let (keyout, csr, subj) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("/CN={cn}"),
            );
            let mut args = vec!["req"];
            args.extend(key);
            args.extend(["-keyout", &keyout, "-out", &csr, "-subj", &subj]);
            openssl(d, &args);
            sign_csr(d, name, &format!("{name}.ext"));
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }

    /// Settings of one upstream link (`proxy.upstream_tls`, …): trust
    /// `ca`, present the client certificate when `client_cert`.
    fn link(&self, table: &str, ca: &str, client_cert: bool) -> Vec<(String, String)> {
        let mut out = vec![(format!("{table}.ca_file"), self.path(ca))];
        if client_cert {
            out.push((format!("{table}.client_cert_file"), self.path("client.crt")));
            out.push((format!("{table}.client_key_file"), self.path("client.key")));
        }
        out
    }

    /// A client for the test's own requests to the TLS gateway.
    fn client(&self) -> reqwest::Client {
        let tls = UpstreamTls {
            ca_file: Some(self.path("ca.crt")),
            client_cert_file: Some(self.path("client.crt")),
            client_key_file: Some(self.path("client.key")),
            server_name: None,
        };
        reqwest::Client::builder()
            .use_preconfigured_tls(tls.client_config().unwrap())
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap()
    }
}

/// Settings as `(name, value)` pairs.
type Settings = Vec<(String, String)>;

fn borrowed(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// TLS in front of a plain storage, requiring a client certificate from
/// the test CA — the storage as a TLS-only service sees it. Counts the
/// handshakes it completed.
struct TlsFront {
    port: u16,
    handshakes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    async fn start(pki: &Pki, backend_port: u16) -> TlsFront {
        let cert = fencer::http::tls_cert::ReloadingCert::load(
            &pki.path("server.crt"),
            &pki.path("server.key"),
        )
        .unwrap();
        let config = cert.server_config_with(Some(&pki.path("ca.crt"))).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let handshakes = Arc::new(AtomicUsize::new(0));
        let counted = handshakes.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, counted) = (acceptor.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(Ok(mut tls)) =
                        tokio::time::timeout(Duration::from_secs(5), acceptor.accept(tcp)).await
                    else {
                        return;
                    };
                    counted.fetch_add(1, Ordering::SeqCst);
                    let Ok(mut plain) =
                        tokio::net::TcpStream::connect(("127.0.0.1", backend_port)).await
                    else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        TlsFront {
            port,
            handshakes,
            task,
        }
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A gateway serving TLS with the test CA's server certificate and
/// requiring client certificates from that CA, in front of `upstream`.
fn tls_gateway(pki: &Pki, upstream: &str, extra: &[(String, String)]) -> Fencer {
    let mut env = vec![
        ("gateway.tls_cert_file".to_owned(), pki.path("server.crt")),
        ("gateway.tls_key_file".to_owned(), pki.path("server.key")),
        ("gateway.tls_client_ca_file".to_owned(), pki.path("ca.crt")),
    ];
    env.extend_from_slice(extra);
    Fencer::gateway(upstream, &borrowed(&env))
}

fn https(f: &Fencer) -> String {
    format!("https://localhost:{}", f.api_port)
}

async fn put(client: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> Resp {
    send(
        client,
        "PUT",
        url,
        headers,
        Some(&json!({ "balance": 1 }).to_string()),
    )
    .await
}

/// The writes the storage applied at `path` (its `_log`).
async fn storage_writes(storage: &Fencer, path: &str) -> Vec<serde_json::Value> {
    let url = format!("{}/_log/{path}", storage.api);
    let log = send(&storage.http, "GET", &url, &[], None).await;
    log.body["writes"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_crosses_every_link_over_tls_and_a_stale_token_is_refused() {
    let pki = Pki::new();
    let storage = Fencer::storage(&[]);
    let front = TlsFront::start(&pki, storage.api_port).await;
    let gateway = tls_gateway(
        &pki,
        &format!("https://localhost:{}", front.port),
        &pki.link("gateway.upstream_tls", "ca.crt", true),
    );
    let gw = https(&gateway);
    let pre = format!("{gw}/_fencer/v1/fences/");
    let mut env = vec![
        ("proxy.upstream".to_owned(), gw.clone()),
        ("sidecar.preregister_url".to_owned(), pre),
    ];
    env.extend(pki.link("proxy.upstream_tls", "ca.crt", true));
    env.extend(pki.link("sidecar.preregister_tls", "ca.crt", true));
    let s = Fencer::sidecar(Backend::Memory, None, &borrowed(&env));

    // Both acquisitions are registered at the gateway over mTLS.
    let first = s.acquire("account:1", 300, 0).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let second = s.acquire("account:1", 10_000, 5_000).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        s.metric("fencer_preregistrations_total", &[("result", "ok")])
            .await,
        2.0,
        "{}",
        s.logs()
    );
    // app → proxy → (TLS) gateway → (TLS) storage.
    let url = format!("{}/kv/accounts/1", s.proxy);
    let w = put(&s.http, &url, &[("Fencing-Lease", &second.lease())]).await;
    assert_eq!(w.status, 200, "{}\n{}", w.body, gateway.logs());
    let writes = storage_writes(&storage, "accounts/1").await;
    assert_eq!(writes[0]["token"], second.token());
    assert!(front.handshakes.load(Ordering::SeqCst) >= 1);

    // The first holder's token, straight to the gateway over mTLS: stale.
    let old = first.body["fencing_token"].as_str().unwrap().to_owned();
    let w = put(
        &pki.client(),
        &format!("{gw}/kv/accounts/1"),
        &[("Fencing-Token", &old)],
    )
    .await;
    assert_eq!(
        (w.status, w.code()),
        (409, "stale_fencing_token"),
        "{}",
        w.body
    );
    assert_eq!(storage_writes(&storage, "accounts/1").await.len(), 1);
    let failures = s.metric("fencer_tls_handshake_failures_total", &[]).await;
    assert_eq!(failures, 0.0);
}

/// Each proxy upstream that must not be trusted answers 502
/// `upstream_error` naming the gateway, counts the failure by reason, and
/// nothing reaches the gateway's handler or the storage; the same
/// gateway with the right settings, and a plain-http chain, work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_ca_wrong_name_and_missing_client_certificate_are_refused() {
    let pki = Pki::new();
    let storage = Fencer::storage(&[]);
    // gateway → storage over plain http still works.
    let gateway = tls_gateway(&pki, &storage.api, &[]);
    let gw = https(&gateway);
    let cases: [(&str, Settings, &str); 3] = [
        (
            "unknown_ca",
            pki.link("proxy.upstream_tls", "other-ca.crt", true),
            "proxy_upstream",
        ),
        (
            "name_mismatch",
            [
                pki.link("proxy.upstream_tls", "ca.crt", true),
                vec![(
                    "proxy.upstream_tls.server_name".to_owned(),
                    "gateway.wrong.example".to_owned(),
                )],
            ]
            .concat(),
            "proxy_upstream",
        ),
        (
            "no_client_certificate",
            pki.link("proxy.upstream_tls", "ca.crt", false),
            "gateway_listener",
        ),
    ];
    for (n, (case, tls, counted_at)) in cases.into_iter().enumerate() {
        let mut env = vec![("proxy.upstream".to_owned(), gw.clone())];
        env.extend(tls);
        let s = Fencer::sidecar(Backend::Memory, None, &borrowed(&env));
        let key = format!("account:{n}");
        let lease = s.acquire(&key, 10_000, 0).await;
        let url = format!("{}/kv/accounts/{n}", s.proxy);
        let w = put(&s.http, &url, &[("Fencing-Lease", &lease.lease())]).await;
        assert_eq!(
            (w.status, w.code()),
            (502, "upstream_error"),
            "{case}: {}",
            w.body
        );
        let message = w.body["message"].as_str().unwrap_or_default();
        assert!(message.contains(&gw), "{case}: {message}");
        let at = if counted_at == "gateway_listener" {
            &gateway
        } else {
            &s
        };
        let mut labels = vec![("link", counted_at)];
        if counted_at == "proxy_upstream" {
            labels.push(("reason", case));
            let logs = s.logs_with(case);
            assert!(logs.contains(case), "{case}: {logs}");
        } else {
            // The proxy learns of the refusal after its side of the
            // handshake, from the server's alert, and counts it too.
            let refused = [("link", "proxy_upstream"), ("reason", "alert_received")];
            assert_eq!(
                s.metric("fencer_tls_handshake_failures_total", &refused)
                    .await,
                1.0,
                "{}",
                s.logs()
            );
        }
        assert!(
            at.metric("fencer_tls_handshake_failures_total", &labels)
                .await
                >= 1.0,
            "{case}: {}",
            at.metrics().await
        );
        assert_eq!(
            storage_writes(&storage, &format!("accounts/{n}"))
                .await
                .len(),
            0
        );
    }
    assert_eq!(
        gateway.metric("fencer_gateway_requests_total", &[]).await,
        0.0,
        "nothing reached the gateway's handler"
    );

    // Pre-registration to a gateway from another CA: the acquire fails
    // (the lease is released) instead of handing out an unregistered token.
    let mut env = vec![(
        "sidecar.preregister_url".to_owned(),
        format!("{gw}/_fencer/v1/fences/"),
    )];
    env.extend(pki.link("sidecar.preregister_tls", "other-ca.crt", true));
    let s = Fencer::sidecar(Backend::Memory, None, &borrowed(&env));
    let refused = s.acquire("account:8", 10_000, 0).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(
        s.metric(
            "fencer_tls_handshake_failures_total",
            &[("link", "preregister"), ("reason", "unknown_ca")]
        )
        .await,
        1.0
    );

    // The same gateway, trusted and with a client certificate: accepted.
    let mut env = vec![("proxy.upstream".to_owned(), gw.clone())];
    env.extend(pki.link("proxy.upstream_tls", "ca.crt", true));
    let s = Fencer::sidecar(Backend::Memory, None, &borrowed(&env));
    let lease = s.acquire("account:9", 10_000, 0).await;
    let url = format!("{}/kv/accounts/9", s.proxy);
    let w = put(&s.http, &url, &[("Fencing-Lease", &lease.lease())]).await;
    assert_eq!(w.status, 200, "{}", w.body);

    // Plain http on every hop, unchanged.
    let plain = Fencer::gateway(&storage.api, &[]);
    let s = Fencer::sidecar(Backend::Memory, None, &[("proxy.upstream", &plain.api)]);
    let lease = s.acquire("account:10", 10_000, 0).await;
    let url = format!("{}/kv/accounts/10", s.proxy);
    let w = put(&s.http, &url, &[("Fencing-Lease", &lease.lease())]).await;
    assert_eq!(w.status, 200, "{}", w.body);
    assert_eq!(storage_writes(&storage, "accounts/10").await.len(), 1);
}

/// An https:// upstream whose server speaks plain HTTP is refused — the
/// request is never sent in clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_that_answers_in_clear_gets_nothing() {
    let pki = Pki::new();
    let storage = Fencer::storage(&[]);
    let plain = Fencer::gateway(&storage.api, &[]);
    let mut env = vec![(
        "proxy.upstream".to_owned(),
        format!("https://localhost:{}", plain.api_port),
    )];
    env.extend(pki.link("proxy.upstream_tls", "ca.crt", true));
    let s = Fencer::sidecar(Backend::Memory, None, &borrowed(&env));
    let lease = s.acquire("account:1", 10_000, 0).await;
    let url = format!("{}/kv/accounts/1", s.proxy);
    let w = put(&s.http, &url, &[("Fencing-Lease", &lease.lease())]).await;
    assert_eq!((w.status, w.code()), (502, "upstream_error"), "{}", w.body);
    assert_eq!(
        plain.metric("fencer_gateway_requests_total", &[]).await,
        0.0
    );
    assert_eq!(storage_writes(&storage, "accounts/1").await.len(), 0);
}

/// A server that accepts the connection and never answers the
/// ClientHello: the proxy gives up within its connect timeout (TCP and
/// handshake together), not the upstream timeout, and counts a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_that_never_finishes_is_bounded_by_the_connect_timeout() {
    let pki = Pki::new();
    // The kernel completes the TCP handshake; nobody ever reads.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut env = vec![
        (
            "proxy.upstream".to_owned(),
            format!("https://localhost:{}", silent.local_addr().unwrap().port()),
        ),
        ("proxy.connect_timeout_ms".to_owned(), "300".to_owned()),
    ];
    env.extend(pki.link("proxy.upstream_tls", "ca.crt", true));
    let s = Fencer::sidecar(Backend::Memory, None, &borrowed(&env));
    let lease = s.acquire("account:1", 10_000, 0).await;
    let url = format!("{}/kv/accounts/1", s.proxy);
    let started = std::time::Instant::now();
    let w = put(&s.http, &url, &[("Fencing-Lease", &lease.lease())]).await;
    let took = started.elapsed();
    assert_eq!((w.status, w.code()), (502, "upstream_error"), "{}", w.body);
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_eq!(
        s.metric(
            "fencer_tls_handshake_failures_total",
            &[("link", "proxy_upstream"), ("reason", "timeout")]
        )
        .await,
        1.0,
        "{}",
        s.logs()
    );
}
