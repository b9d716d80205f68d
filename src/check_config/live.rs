//! `check-config --live`: a pre-flight that connects to everything the
//! role will use and reports each as a row of a table, like `linkerd check`.
//!
//! Each check goes through the role's own client code — the backend the
//! sidecar would build and its readiness ping (Redis `PING` and the
//! eviction policy, a PostgreSQL or MySQL statement on the lock table, a
//! ZooKeeper `exists`), the gateway's fence-store connect and ping, the
//! forwarder the proxy and gateway send requests with — so a green row
//! means the role's own code got through, not that some other client did.
//! Each row is bounded by [`CHECK_TIMEOUT`]. Like the role's start, the
//! backend and fence-store checks create their tables when missing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;

use super::role::Role;
use crate::gateway::settings::FenceStoreKind;
use crate::lock::settings::{BackendKind, RedisMode};
use crate::proxy::forward::Forwarder;
use crate::settings::{redact_url, Settings};

/// The most one check may take: enough for a connect and a round trip
/// across a region, short enough for an init container.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// One row of the table.
pub struct Row {
    pub check: &'static str,
    /// What was contacted, passwords redacted.
    pub target: String,
    pub ok: bool,
    pub detail: String,
}

/// Runs every check of `role` (concurrently: the table takes as long as
/// the slowest check, not their sum).
pub async fn run(settings: &Settings, role: Role) -> Vec<Row> {
    let mut checks: Vec<futures_util::future::BoxFuture<'_, Row>> = Vec::new();
    match role {
        Role::Sidecar => {
            checks.push(Box::pin(lock_backend(settings)));
            let p = &settings.proxy;
            if p.enabled {
                let tls = (crate::http::tls_client::PROXY, &p.upstream_tls);
                checks.push(Box::pin(http_get(
                    "proxy upstream",
                    &p.upstream,
                    tls,
                    "/",
                    None,
                )));
            }
            let pre = &settings.sidecar.preregister_url;
            if !pre.is_empty() {
                let tls = (
                    crate::http::tls_client::PREREGISTER,
                    &settings.sidecar.preregister_tls,
                );
                checks.push(Box::pin(fence_api(pre, tls)));
            }
        }
        Role::Gateway => {
            checks.push(Box::pin(fence_store(settings)));
            let g = &settings.gateway;
            let tls = (crate::http::tls_client::GATEWAY, &g.upstream_tls);
            checks.push(Box::pin(http_get(
                "gateway upstream",
                &g.upstream,
                tls,
                "/",
                None,
            )));
        }
        Role::Storage if settings.storage.backend == FenceStoreKind::Postgres => {
            checks.push(Box::pin(storage_postgres(settings)));
        }
        Role::Storage | Role::Inject | Role::Dev => {}
    }
    futures_util::future::join_all(checks).await
}

/// The table, columns padded to their widest cell.
pub fn table(rows: &[Row]) -> String {
    let head = ["CHECK", "TARGET", "RESULT", "DETAIL"];
    let cells: Vec<[String; 4]> = rows
        .iter()
        .map(|r| {
            [
                r.check.to_owned(),
                r.target.clone(),
                if r.ok { "ok" } else { "FAIL" }.to_owned(),
                r.detail.clone(),
            ]
        })
        .collect();
    let width = |i: usize| {
        cells
            .iter()
            .map(|c| c[i].len())
            .chain([head[i].len()])
            .max()
            .unwrap_or(0)
    };
    let w = [width(0), width(1), width(2)];
    let line = |c: [&str; 4]| {
        format!(
            "{:w0$}  {:w1$}  {:w2$}  {}",
            c[0],
            c[1],
            c[2],
            c[3],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2]
        )
        .trim_end()
        .to_owned()
    };
    let mut out = line(head);
    for c in &cells {
        out.push('\n');
        out.push_str(&line([&c[0], &c[1], &c[2], &c[3]]));
    }
    out.push('\n');
    out
}

fn row(
    check: &'static str,
    target: String,
    started: Instant,
    result: Result<String, String>,
) -> Row {
    let ms = started.elapsed().as_millis();
    let (ok, detail) = match result {
        Ok(d) => (true, format!("{d} ({ms} ms)")),
        Err(e) => (false, e),
    };
    Row {
        check,
        target,
        ok,
        detail,
    }
}

/// Where the sidecar's backend is, as an operator would name it.
fn backend_target(s: &Settings) -> String {
    let b = &s.backend;
    let join = |v: &[String]| {
        v.iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",")
    };
    match b.kind {
        Some(BackendKind::Redis) => match b.redis.mode {
            RedisMode::Single => redact_url(&b.redis.url),
            RedisMode::Sentinel => format!(
                "sentinel {} at {}",
                b.redis.master_name,
                b.redis.sentinels.join(",")
            ),
            RedisMode::Cluster => join(&b.redis.nodes),
        },
        Some(BackendKind::RedLock) => join(&b.redlock.urls),
        Some(BackendKind::Postgres) => redact_url(&b.postgres.url),
        Some(BackendKind::MySql) => redact_url(&b.mysql.url),
        Some(BackendKind::ZooKeeper) => b.zookeeper.connect.clone(),
        Some(BackendKind::Etcd) => join(&b.etcd.endpoints),
        Some(BackendKind::Memory) => "in-process".into(),
        None => "-".into(),
    }
}

/// The backend the sidecar would build, asked for its readiness until it
/// answers or the time is up (a new backend connects, and creates its
/// schema, in the background).
async fn lock_backend(s: &Settings) -> Row {
    let started = Instant::now();
    let target = backend_target(s);
    let name = s.backend.kind.map_or("none", |k| k.as_str());
    let result = async {
        let wake = Arc::new(crate::sidecar::waiters::WaitQueues::new(1));
        let registry = prometheus::Registry::new();
        let backend =
            crate::sidecar::build_backend(s, wake, &registry).map_err(|e| e.to_string())?;
        let deadline = started + CHECK_TIMEOUT;
        // Each attempt is cut short enough to leave room for another, so
        // the row shows the backend's own error, not only a timeout.
        let attempt = Duration::from_secs(2);
        let mut last = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left.min(attempt), backend.ping()).await {
                Ok(Ok(())) => return Ok(format!("{name} answered")),
                Ok(Err(e)) => last = Some(e.to_string()),
                Err(_) => {}
            }
            if Instant::now() + Duration::from_millis(200) >= deadline {
                return Err(match last {
                    Some(e) => e,
                    None => format!("no answer within {CHECK_TIMEOUT:?}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    .await;
    row("lock backend", target, started, result)
}

/// The gateway's fence store, connected as the gateway connects it.
async fn fence_store(s: &Settings) -> Row {
    use crate::gateway::fence_store::etcd::{EtcdFenceOptions, EtcdFences};
    use crate::gateway::fence_store::FenceError;
    let started = Instant::now();
    let g = &s.gateway;
    let (target, result) = match g.fence_store {
        None => (
            "-".to_owned(),
            Err("gateway.fence_store is not set".to_owned()),
        ),
        Some(FenceStoreKind::Memory) => (
            "in-process".to_owned(),
            Ok("memory: nothing to reach".to_owned()),
        ),
        Some(FenceStoreKind::Postgres) => {
            let options = crate::gateway::fence_store::postgres::PgFenceOptions {
                url: &g.postgres_url,
                ca_file: g.postgres_ca_file.as_deref(),
                pool_size: 1,
                request_timeout: CHECK_TIMEOUT,
                startup: CHECK_TIMEOUT,
            };
            let connect = crate::gateway::fence_store::postgres::PgFences::connect(&options);
            (
                redact_url(&g.postgres_url),
                ping_store("postgres", connect).await,
            )
        }
        Some(FenceStoreKind::Mysql) => {
            let options = crate::gateway::fence_store::mysql::MyFenceOptions {
                url: &g.mysql_url,
                ca_file: g.mysql_ca_file.as_deref(),
                pool_size: 1,
                request_timeout: CHECK_TIMEOUT,
                startup: CHECK_TIMEOUT,
            };
            let connect = crate::gateway::fence_store::mysql::MyFences::connect(&options);
            (redact_url(&g.mysql_url), ping_store("mysql", connect).await)
        }
        Some(FenceStoreKind::Etcd) => {
            let connect = async {
                let config = g
                    .etcd_client_config()
                    .map_err(|e| FenceError::Unavailable(e.to_string()))?;
                let client =
                    crate::etcd::EtcdClient::new(&config).map_err(FenceError::Unavailable)?;
                EtcdFences::connect(EtcdFenceOptions {
                    client,
                    prefix: g.etcd_prefix.clone(),
                    request_timeout: CHECK_TIMEOUT,
                    stamp_hold: std::time::Duration::from_millis(g.stamp_hold_ms()),
                    startup: CHECK_TIMEOUT,
                })
                .await
                .map_err(FenceError::Unavailable)
            };
            (
                g.etcd_endpoints.join(","),
                ping_store("etcd", connect).await,
            )
        }
    };
    row("fence store", target, started, result)
}

/// A fence store's connect (the gateway's start-up retries, cut at
/// [`CHECK_TIMEOUT`]) and then its readiness ping.
async fn ping_store<S, C>(name: &str, connect: C) -> Result<String, String>
where
    S: crate::gateway::fence_store::FenceStore,
    C: std::future::Future<Output = Result<S, crate::gateway::fence_store::FenceError>>,
{
    bounded(async {
        let store = connect.await.map_err(|e| e.to_string())?;
        store.ping().await.map_err(|e| e.to_string())?;
        Ok(format!("{name} answered"))
    })
    .await
}

/// The demo storage's PostgreSQL.
async fn storage_postgres(s: &Settings) -> Row {
    let started = Instant::now();
    let st = &s.storage;
    let r = bounded(async {
        crate::storage::build(s).await.map_err(|e| e.to_string())?;
        Ok("postgres answered".to_owned())
    })
    .await;
    row("storage postgres", redact_url(&st.postgres_url), started, r)
}

/// `f` cut off at [`CHECK_TIMEOUT`].
async fn bounded<F>(f: F) -> Result<String, String>
where
    F: std::future::Future<Output = Result<String, String>>,
{
    tokio::time::timeout(CHECK_TIMEOUT, f)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {CHECK_TIMEOUT:?}")))
}

/// A link's TLS settings, as the forwarders take them.
type Tls<'a> = (
    crate::http::tls_client::Link,
    &'a crate::http::tls_client::UpstreamTls,
);

/// `GET base+path` through the forwarder the role sends with; any HTTP
/// answer passes unless `expect` names the one required (status, error
/// code).
async fn http_get(
    check: &'static str,
    base: &str,
    tls: Tls<'_>,
    path: &str,
    expect: Option<(u16, &'static str)>,
) -> Row {
    let started = Instant::now();
    let target = format!("{}{}", redact_url(base).trim_end_matches('/'), path);
    let result = bounded(async {
        let fwd =
            Forwarder::new(base, tls, CHECK_TIMEOUT, CHECK_TIMEOUT).map_err(|e| e.to_string())?;
        let req = hyper::Request::get(path)
            .body(crate::proxy::full(bytes::Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = match fwd.forward(req).await {
            Ok(r) => r,
            Err(e) => return Err(explain_connect(base, e.to_string()).await),
        };
        let status = resp.status();
        let Some((want, code)) = expect else {
            return Ok(format!("HTTP {}", status.as_u16()));
        };
        let body = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        if status.as_u16() == want && json["error"] == code {
            Ok(format!("HTTP {want} {code}, as a fencer gateway answers"))
        } else {
            Err(format!(
                "HTTP {}: not a fencer gateway's fence API (expected {want} {code})",
                status.as_u16()
            ))
        }
    })
    .await;
    row(check, target, started, result)
}

/// A failed request's error, with the reason a plain connect to the same
/// address fails (the HTTP client says only "client error (Connect)").
async fn explain_connect(base: &str, error: String) -> String {
    let Some(addr) = url::Url::parse(base)
        .ok()
        .and_then(|u| Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?)))
    else {
        return error;
    };
    match tokio::time::timeout(CHECK_TIMEOUT, tokio::net::TcpStream::connect(&addr)).await {
        Ok(Err(e)) => format!("connect to {addr}: {e}"),
        Err(_) => format!("connect to {addr}: no answer within {CHECK_TIMEOUT:?}"),
        Ok(Ok(_)) => error,
    }
}

/// The gateway's pre-registration endpoint: a `GET` (never a token, so
/// no mark moves) must get the fence API's 405 `method_not_allowed`.
async fn fence_api(url: &str, tls: Tls<'_>) -> Row {
    let parsed = url::Url::parse(url).ok();
    let (base, path) = match &parsed {
        Some(u) => (
            u[..url::Position::BeforePath].to_owned(),
            format!("{}fencer-check", u.path()),
        ),
        None => (url.to_owned(), "/".to_owned()),
    };
    http_get(
        "gateway fence API",
        &base,
        tls,
        &path,
        Some((405, "method_not_allowed")),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_aligns_its_columns() {
        let rows = [
            Row {
                check: "lock backend",
                target: "redis://127.0.0.1:6379/0".into(),
                ok: true,
                detail: "redis answered (1 ms)".into(),
            },
            Row {
                check: "proxy upstream",
                target: "http://g:8080/".into(),
                ok: false,
                detail: "refused".into(),
            },
        ];
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        let col = lines[0].find("RESULT").unwrap();
        assert_eq!(&lines[1][col..col + 2], "ok");
        assert_eq!(&lines[2][col..col + 4], "FAIL");
    }
}
