//! OpenTelemetry across the hops (issue 31 item 3), against real
//! processes: a `fencer sidecar` whose proxy forwards to a `fencer gateway`
//! in front of a recording storage, both exporting spans over OTLP/HTTP to
//! a small collector in this test (protobuf decoded with the OTLP types).
//!
//! - One trace runs app → `proxy.request` → `proxy.forward` →
//!   `gateway.request` → (`gateway.check`, `gateway.forward`) → storage,
//!   each span the child of the one before, and the storage receives
//!   exactly one `traceparent`: the gateway's forward span's. The lock API's
//!   acquire / renew / release are spans of the app's trace too.
//! - Two `traceparent` headers from the app are not guessed between: the
//!   storage still gets one, of a new trace.
//! - Tracing off: nothing is exported, and no `traceparent` is added or
//!   changed.
//! - Spans queued at SIGTERM are exported before exit; a collector that
//!   is not there costs a count and one warning, never a lock or a write.
//!
//! The trace is printed as a tree (`cargo test --test tracing_otlp --
//! --nocapture`).

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;

use common::upstream::Recorder;
use common::*;

/// One span as the collector received it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    kind: i32,
    attrs: BTreeMap<String, String>,
}

/// The collector: `POST /v1/traces` with an OTLP protobuf body.
struct Collector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    requests: Arc<Mutex<u32>>,
}

fn text(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attrs(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

impl Collector {
    async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(0));
        let (s2, r2) = (spans.clone(), requests.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (spans, requests) = (s2.clone(), r2.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let (spans, requests) = (spans.clone(), requests.clone());
                        async move {
                            *requests.lock().unwrap() += 1;
                            assert_eq!(req.uri().path(), "/v1/traces");
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let export = ExportTraceServiceRequest::decode(body).unwrap();
                            let mut got = spans.lock().unwrap();
                            for rs in export.resource_spans {
                                let res =
                                    attrs(&rs.resource.map(|r| r.attributes).unwrap_or_default());
                                let service = res.get("service.name").cloned().unwrap_or_default();
                                for ss in rs.scope_spans {
                                    for s in ss.spans {
                                        got.push(Received {
                                            service: service.clone(),
                                            name: s.name.clone(),
                                            trace_id: hex(&s.trace_id),
                                            span_id: hex(&s.span_id),
                                            parent: hex(&s.parent_span_id),
                                            kind: s.kind,
                                            attrs: attrs(&s.attributes),
                                        });
                                    }
                                }
                            }
                            Ok::<_, std::convert::Infallible>(
                                Response::builder()
                                    .header("content-type", "application/x-protobuf")
                                    .body(Full::new(Bytes::new()))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Collector {
            addr,
            spans,
            requests,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until a span named `name` of `trace` arrived.
    async fn wait_for(&self, trace: &str, names: &[&str]) -> Vec<Received> {
        let done = eventually(Duration::from_secs(10), || {
            let spans = self.spans();
            names
                .iter()
                .all(|n| spans.iter().any(|s| s.trace_id == trace && s.name == *n))
        })
        .await;
        let spans = self.spans();
        assert!(
            done,
            "spans {names:?} of trace {trace} never arrived; got {:#?}",
            spans
        );
        spans.into_iter().filter(|s| s.trace_id == trace).collect()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The app's trace: one id, a span id per call the app makes.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

fn traceparent(span: &str) -> String {
    format!("00-{TRACE}-{span}-01")
}

/// Settings that export every span quickly.
fn exporting(collector: &str) -> Vec<(&'static str, String)> {
    vec![
        ("tracing.otlp_endpoint", collector.to_owned()),
        ("tracing.export_interval_ms", "100".into()),
    ]
}

fn borrowed<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Prints the spans of one trace as a tree under the app's spans.
fn print_tree(spans: &[Received], app_spans: &[(&str, &str)]) {
    fn walk(spans: &[Received], parent: &str, depth: usize, out: &mut String) {
        let mut children: Vec<&Received> = spans.iter().filter(|s| s.parent == parent).collect();
        children.sort_by_key(|s| s.name.clone());
        for s in children {
            let keep = [
                "fencer.lock.key",
                "fencer.token",
                "fencer.outcome",
                "fencer.error",
                "http.response.status_code",
            ];
            let shown: Vec<String> = s
                .attrs
                .iter()
                .filter(|(k, _)| keep.contains(&k.as_str()))
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            out.push_str(&format!(
                "{}{} [{}] span={} {}\n",
                "  ".repeat(depth),
                s.name,
                s.service,
                s.span_id,
                shown.join(" ")
            ));
            walk(spans, &s.span_id, depth + 1, out);
        }
    }
    let mut out = format!("trace {TRACE}\n");
    for (name, id) in app_spans {
        out.push_str(&format!("  {name} [app] span={id}\n"));
        walk(spans, id, 2, &mut out);
    }
    println!("{out}");
}

/// A lock API call `op` on `key` from the app's span `span`; must answer 200.
async fn lock_call(
    sidecar: &Fencer,
    key: &str,
    op: &str,
    span: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let resp = sidecar
        .http
        .post(format!("{}{}", sidecar.api, Fencer::path(key, op)))
        .header("traceparent", traceparent(span))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{op}");
    resp.json().await.unwrap()
}

fn one<'a>(spans: &'a [Received], name: &str) -> &'a Received {
    let found: Vec<&Received> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "one `{name}` span, got {found:#?}");
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_proxy_gateway_and_storage() {
    let collector = Collector::start().await;
    let storage = Recorder::start().await;
    // The gateway is turned on by the standard variable, the sidecar by
    // its own setting.
    let gateway = Fencer::gateway(
        &storage.url(),
        &[
            ("!OTEL_EXPORTER_OTLP_ENDPOINT", &collector.url()),
            ("tracing.export_interval_ms", "100"),
        ],
    );
    let mut sidecar_settings = exporting(&collector.url());
    sidecar_settings.push(("proxy.upstream", gateway.api.clone()));
    // The acquire pre-registers its token at the gateway: that hop joins
    // the acquire's trace.
    sidecar_settings.push((
        "sidecar.preregister_url",
        format!("{}/_fencer/v1/fences/", gateway.api),
    ));
    let sidecar = Fencer::sidecar(Backend::Memory, None, &borrowed(&sidecar_settings));
    sidecar.wait_ready();
    gateway.wait_ready();
    let http = reqwest::Client::new();
    let key = "orders:7";

    // The app's calls, each from a span of its own.
    let (acquire_span, renew_span, write_span, release_span) = (
        "a000000000000001",
        "a000000000000002",
        "a000000000000003",
        "a000000000000004",
    );
    let acquired = lock_call(
        &sidecar,
        key,
        "acquire",
        acquire_span,
        serde_json::json!({"ttl_ms": 10000}),
    )
    .await;
    let lease = acquired["lease_id"].as_str().expect("acquired").to_owned();
    lock_call(
        &sidecar,
        key,
        "renew",
        renew_span,
        serde_json::json!({"lease_id": lease}),
    )
    .await;

    let written = http
        .put(format!("{}/kv/orders/7", sidecar.proxy))
        .header("traceparent", traceparent(write_span))
        .header("tracestate", "app=1")
        .header("Fencing-Lease", &lease)
        .body("{\"n\":1}")
        .send()
        .await
        .unwrap();
    assert_eq!(written.status(), 200, "{}", written.text().await.unwrap());

    lock_call(
        &sidecar,
        key,
        "release",
        release_span,
        serde_json::json!({"lease_id": lease}),
    )
    .await;

    let spans = collector
        .wait_for(
            TRACE,
            &[
                "lock.acquire",
                "lock.renew",
                "lock.release",
                "proxy.request",
                "proxy.forward",
                "gateway.request",
                "gateway.check",
                "gateway.forward",
            ],
        )
        .await;
    print_tree(
        &spans,
        &[
            ("app.acquire", acquire_span),
            ("app.renew", renew_span),
            ("app.write", write_span),
            ("app.release", release_span),
        ],
    );

    // The lock API: each call a server span under the app's span.
    for (name, parent) in [
        ("lock.acquire", acquire_span),
        ("lock.renew", renew_span),
        ("lock.release", release_span),
    ] {
        let s = one(&spans, name);
        assert_eq!(s.parent, parent, "{name}'s parent");
        assert_eq!(s.service, "fencer-sidecar");
        assert_eq!(s.attrs["fencer.lock.key"], key);
        assert_eq!(s.attrs["fencer.outcome"], "ok");
        assert_eq!(s.kind, 2, "{name} is a server span");
    }
    assert_eq!(
        one(&spans, "lock.acquire").attrs["fencer.token"],
        acquired["token"].to_string()
    );
    let pre: Vec<&Received> = spans
        .iter()
        .filter(|s| s.name == "gateway.request" && s.parent == one(&spans, "lock.acquire").span_id)
        .collect();
    assert_eq!(
        pre.len(),
        1,
        "the pre-registration's gateway span under lock.acquire"
    );
    assert_eq!(pre[0].service, "fencer-gateway");
    assert_eq!(pre[0].attrs["fencer.outcome"], "accepted");
    assert_eq!(pre[0].attrs["fencer.lock.key"], key);

    // The write: app → proxy → gateway → storage, each hop the child of
    // the one before.
    let proxy = one(&spans, "proxy.request");
    let proxy_fwd = one(&spans, "proxy.forward");
    let gw = spans
        .iter()
        .find(|s| s.name == "gateway.request" && s.parent == proxy_fwd.span_id)
        .expect("the gateway continues the proxy's forward");
    let check = one(&spans, "gateway.check");
    let gw_fwd = one(&spans, "gateway.forward");
    assert_eq!(proxy.parent, write_span);
    assert_eq!(proxy.service, "fencer-sidecar");
    assert_eq!(proxy.attrs["fencer.outcome"], "forwarded");
    assert_eq!(proxy.attrs["fencer.lock.key"], key);
    assert_eq!(proxy_fwd.parent, proxy.span_id);
    assert_eq!(proxy_fwd.kind, 3, "proxy.forward is a client span");
    assert_eq!(
        gw.parent, proxy_fwd.span_id,
        "the gateway continues the proxy's forward"
    );
    assert_eq!(gw.service, "fencer-gateway");
    assert_eq!(gw.attrs["fencer.outcome"], "accepted");
    assert_eq!(gw.attrs["fencer.lock.key"], key);
    assert_eq!(check.parent, gw.span_id);
    assert_eq!(check.attrs["fencer.outcome"], "admitted");
    assert_eq!(gw_fwd.parent, gw.span_id);
    assert_eq!(gw_fwd.attrs["http.response.status_code"], "200");
    let seen = storage.seen();
    assert_eq!(seen.len(), 1);
    println!("storage received traceparent: {:?}", seen[0].traceparents);
    assert_eq!(
        seen[0].traceparents,
        [format!("00-{TRACE}-{}-01", gw_fwd.span_id)],
        "the storage gets one traceparent: the gateway forward's"
    );

    // Two traceparents from the app: neither is taken; the storage still
    // receives exactly one, of a trace of fencer's own.
    let lease2 = sidecar.acquire(key, 10_000, 0).await.lease();
    let written = http
        .put(format!("{}/kv/orders/7", sidecar.proxy))
        .header("traceparent", traceparent("b000000000000001"))
        .header(
            "traceparent",
            "00-11111111111111111111111111111111-2222222222222222-01",
        )
        .header("Fencing-Lease", &lease2)
        .body("{\"n\":2}")
        .send()
        .await
        .unwrap();
    assert_eq!(written.status(), 200);
    let seen = storage.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].traceparents.len(), 1, "{:?}", seen[1].traceparents);
    let tp = &seen[1].traceparents[0];
    assert!(
        !tp.contains(TRACE) && !tp.contains("11111111111111111111111111111111"),
        "a doubled traceparent must not pick a parent: {tp}"
    );

    // The export is counted (the counter moves once the answer is in).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        gateway
            .metric("fencer_otel_spans_total", &[("result", "exported")])
            .await
            >= 3.0
    );
    assert_eq!(
        sidecar
            .metric("fencer_otel_export_failures_total", &[])
            .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_off_exports_nothing_and_adds_no_traceparent() {
    let collector = Collector::start().await;
    let storage = Recorder::start().await;
    // Everything but the endpoint; the standard variable set empty.
    let gateway = Fencer::gateway(
        &storage.url(),
        &[
            ("tracing.export_interval_ms", "100"),
            ("!OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        ],
    );
    let sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &[
            ("proxy.upstream", &gateway.api),
            ("tracing.export_interval_ms", "100"),
            ("!OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        ],
    );
    sidecar.wait_ready();
    gateway.wait_ready();
    let http = reqwest::Client::new();
    let lease = sidecar.acquire("orders:8", 10_000, 0).await.lease();
    for traceparent in [None, Some(traceparent("c000000000000001"))] {
        let mut req = http
            .put(format!("{}/kv/orders/8", sidecar.proxy))
            .header("Fencing-Lease", &lease)
            .body("{}");
        if let Some(tp) = &traceparent {
            req = req.header("traceparent", tp);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let seen = storage.seen();
        let last = seen.last().unwrap();
        assert_eq!(
            last.traceparents,
            traceparent.into_iter().collect::<Vec<_>>(),
            "tracing off: the app's trace headers pass untouched, none is added"
        );
    }
    sidecar.renew("orders:8", &lease, 10_000).await;
    sidecar.release("orders:8", &lease).await;
    // Ten export intervals: nothing may arrive.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        *collector.requests.lock().unwrap(),
        0,
        "tracing off, yet exports arrived"
    );
    assert_eq!(
        sidecar
            .metric("fencer_otel_spans_total", &[("result", "exported")])
            .await,
        0.0
    );
}

/// Spans still queued at SIGTERM are exported before the process exits
/// (the export interval here is far longer than the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_queued_at_exit_are_flushed() {
    let collector = Collector::start().await;
    let mut sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &[
            ("tracing.otlp_endpoint", &collector.url()),
            ("tracing.export_interval_ms", "60000"),
        ],
    );
    sidecar.wait_ready();
    lock_call(
        &sidecar,
        "exit:1",
        "acquire",
        "d000000000000001",
        serde_json::json!({}),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(collector.spans().is_empty(), "exported before the exit");
    assert_eq!(sidecar.terminate(), Some(0));
    let spans = collector.wait_for(TRACE, &["lock.acquire"]).await;
    assert_eq!(one(&spans, "lock.acquire").parent, "d000000000000001");
}

/// A collector that is not there: locks and writes go on, the failure is
/// counted and logged once, and SIGTERM still exits promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_costs_only_a_count() {
    let closed = format!("http://127.0.0.1:{}", free_port());
    let mut sidecar = Fencer::sidecar(
        Backend::Memory,
        None,
        &[
            ("tracing.otlp_endpoint", &closed),
            ("tracing.export_interval_ms", "100"),
            ("tracing.export_timeout_ms", "500"),
        ],
    );
    sidecar.wait_ready();
    for i in 0..3 {
        let key = format!("down:{i}");
        let lease = sidecar.acquire(&key, 10_000, 0).await.lease();
        assert_eq!(sidecar.release(&key, &lease).await.status, 200);
    }
    let counted = eventually(Duration::from_secs(10), || {
        sidecar.logs().contains("OTLP span export failed")
    })
    .await;
    assert!(counted, "{}", sidecar.logs());
    // A second batch, failing too.
    let lease = sidecar.acquire("down:again", 10_000, 0).await.lease();
    sidecar.release("down:again", &lease).await;
    let mut failures = 0.0;
    for _ in 0..50 {
        failures = sidecar
            .metric("fencer_otel_export_failures_total", &[])
            .await;
        if failures >= 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(failures >= 2.0, "{failures} failed exports");
    assert!(
        sidecar
            .metric("fencer_otel_spans_total", &[("result", "failed")])
            .await
            >= 2.0
    );
    assert_eq!(
        sidecar.logs().matches("OTLP span export failed").count(),
        1,
        "one warning, not one per batch"
    );
    let started = std::time::Instant::now();
    assert_eq!(sidecar.terminate(), Some(0));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "exit took {:?}",
        started.elapsed()
    );
}

/// Dapr's lock API is traced like the lock API: a `dapr.lock` span, child
/// of the app's `traceparent`, with its outcome; `dapr.unlock` likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapr_calls_are_spans_of_the_callers_trace() {
    let collector = Collector::start().await;
    let sidecar = Fencer::sidecar_with_config(
        Backend::Memory,
        "[[sidecar.dapr_lock_stores]]\nname = \"orders\"\n",
        &[
            ("tracing.otlp_endpoint", &collector.url()),
            ("tracing.export_interval_ms", "100"),
        ],
    );
    sidecar.wait_ready();
    let resp = sidecar
        .http
        .post(format!("{}/v1.0-alpha1/lock/orders", sidecar.api))
        .header("traceparent", traceparent("da00000000000001"))
        .json(&serde_json::json!({"resourceId": "r1", "lockOwner": "o1", "expiryInSeconds": 30}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let unlock = sidecar
        .http
        .post(format!("{}/v1.0-alpha1/unlock/orders", sidecar.api))
        .header("traceparent", traceparent("da00000000000002"))
        .json(&serde_json::json!({"resourceId": "r1", "lockOwner": "someone-else"}))
        .send()
        .await
        .unwrap();
    assert_eq!(unlock.status(), 200);
    let spans = collector
        .wait_for(TRACE, &["dapr.lock", "dapr.unlock"])
        .await;
    let lock = one(&spans, "dapr.lock");
    assert_eq!(lock.parent, "da00000000000001");
    assert_eq!(lock.attrs["fencer.outcome"], "ok", "{lock:#?}");
    assert_eq!(one(&spans, "dapr.unlock").parent, "da00000000000002");
}
