//! The floor under the sidecar's instructions per lock cycle: what the
//! crates the sidecar is built on (hyper, tokio, redis-rs) cost for one
//! lock cycle with **none of fencer's work** — two HTTP/1.1 requests on a
//! keep-alive connection, each answered after one Lua script call on one
//! multiplexed Redis connection. No JSON parsing of the request, no lease
//! table, no token, no signing, no metrics, no deadline: the least any
//! server built on these crates can do per cycle.
//!
//! `bench/instructions.py --binary target/profiling/examples/floor` counts
//! it exactly like the sidecar (it speaks the two routes the script uses,
//! and reads the same `FENCER__SIDECAR__LISTEN` and
//! `FENCER__BACKEND__REDIS__URL`). docs/performance.md compares the two:
//! issue 32's target (70 000 per cycle) against this floor says how much of
//! the target is left for fencer's own work.
//!
//! ```sh
//! cargo build --profile profiling --example floor
//! python3 bench/instructions.py --binary target/profiling/examples/floor
//! ```

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// The sidecar's allocator, so the floor pays what the sidecar pays.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const LEASE: &str = "floor-lease-0123456789abcdef";

/// One script call per request, as the sidecar makes one per operation.
const ACQUIRE: &str =
    "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end \
                       if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end return 0";
const RELEASE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

fn main() {
    let listen = std::env::var("FENCER__SIDECAR__LISTEN").unwrap_or("127.0.0.1:8700".into());
    let redis_url =
        std::env::var("FENCER__BACKEND__REDIS__URL").unwrap_or("redis://127.0.0.1:6379".into());
    // The sidecar's runtime: multi-threaded, one worker (its default).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let client = redis::Client::open(redis_url.as_str()).expect("redis url");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection");
        let scripts =
            std::sync::Arc::new((redis::Script::new(ACQUIRE), redis::Script::new(RELEASE)));
        let listener = tokio::net::TcpListener::bind(&listen)
            .await
            .expect("listen");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let (conn, scripts) = (conn.clone(), scripts.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let (mut conn, scripts) = (conn.clone(), scripts.clone());
                    async move { Ok::<_, Infallible>(answer(req, &mut conn, &scripts).await) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}

async fn answer(
    req: Request<hyper::body::Incoming>,
    conn: &mut redis::aio::MultiplexedConnection,
    scripts: &(redis::Script, redis::Script),
) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let (key, acquire) = match path.strip_suffix("/acquire") {
        Some(k) => (k.to_owned(), true),
        None => (
            path.strip_suffix("/release").unwrap_or(path).to_owned(),
            false,
        ),
    };
    // The body is read (a server must), not parsed.
    let _ = req.into_body().collect().await;
    let body: &'static str = if acquire {
        let _: Result<i64, _> = scripts
            .0
            .key(&key)
            .arg(LEASE)
            .arg(10_000)
            .invoke_async(conn)
            .await;
        r#"{"lease_id":"floor-lease-0123456789abcdef","token":1}"#
    } else {
        let _: Result<i64, _> = scripts.1.key(&key).arg(LEASE).invoke_async(conn).await;
        r#"{"released":true}"#
    };
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("response")
}
