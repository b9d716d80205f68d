//! The lock API's OpenAPI 3.1 description (docs/openapi.json, served at
//! `/openapi.json`): every route the router has is in it, and the API
//! conforms to it under schemathesis (PyPI; tests/run.sh installs it):
//! coverage, fuzzing and stateful phases (acquire → renew / keepalive /
//! release / get through the spec's links) against `fencer dev`, with 0
//! server errors, 0 undocumented status codes and 0 response-schema
//! violations (every response object is `additionalProperties: false`, so
//! a field the spec lacks fails).

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use common::dev::Dev;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn spec() -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("docs/openapi.json")).unwrap())
        .unwrap()
}

/// `(METHOD, path)` of every `.route(...)` in the lock API's router.
fn router_routes() -> BTreeSet<(String, String)> {
    // The lock API's routes, and Dapr's that it serves beside them.
    let src = [
        "src/sidecar/api.rs",
        "src/sidecar/dapr.rs",
        "src/sidecar/api_semaphores.rs",
        "src/sidecar/api_multi.rs",
    ]
    .map(|f| std::fs::read_to_string(root().join(f)).unwrap())
    .join("\n");
    let re =
        regex::Regex::new(r#"\.route\(\s*"([^"]+)",\s*(get|post|put|patch|delete)\("#).unwrap();
    re.captures_iter(&src)
        .map(|c| (c[2].to_uppercase(), c[1].to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spec_describes_every_route_and_is_what_the_api_serves() {
    let spec = spec();
    let documented: BTreeSet<(String, String)> = spec["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, ops)| {
            ops.as_object()
                .unwrap()
                .keys()
                .map(move |m| (m.to_uppercase(), path.clone()))
        })
        .collect();
    let routes = router_routes();
    assert!(routes.len() >= 10, "router scan found only {routes:?}");
    assert_eq!(routes, documented, "router and docs/openapi.json differ");
    assert_eq!(spec["openapi"], "3.1.0");

    let dev = Dev::start();
    let served = reqwest::get(format!("{}/openapi.json", dev.api))
        .await
        .unwrap();
    assert_eq!(served.status(), 200);
    assert_eq!(served.headers()["content-type"], "application/json");
    assert_eq!(served.json::<Value>().await.unwrap(), spec);
}

#[test]
fn schemathesis_finds_no_server_error_and_no_schema_violation() {
    let st = Command::new("st").arg("--version").output();
    assert!(
        st.is_ok_and(|o| o.status.success()),
        "schemathesis is not installed: python3 -m pip install schemathesis (tests/run.sh does)"
    );
    // The spec as published, with one change for testability: an acquire
    // may wait up to 300 s for a held key (as documented); generated ones
    // wait at most 1 s so a case never outlives the request timeout.
    let mut spec = spec();
    for schema in [
        "AcquireRequest",
        "HoldRequest",
        "PermitRequest",
        "PermitHoldRequest",
        "MultiAcquireRequest",
    ] {
        spec["components"]["schemas"][schema]["properties"]["wait_ms"]["maximum"] = 1000.into();
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, serde_json::to_vec(&spec).unwrap()).unwrap();
    let dev = Dev::start();
    let out = Command::new("st")
        .arg("run")
        .arg(&file)
        .args(["--url", &dev.api])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        ])
        // A hold stream lasts as long as its lease is renewed: not a
        // request/response schemathesis can time.
        .args(["--exclude-operation-id", "hold"])
        .args(["--exclude-operation-id", "holdPermit"])
        .args(["--max-examples", "25", "--max-time", "60", "--request-timeout", "10"])
        .args(["--seed", "20261123"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let cases = text
        .lines()
        .find(|l| l.contains("generated,"))
        .unwrap_or("no summary line");
    eprintln!("schemathesis: {}", cases.trim());
    assert!(out.status.success(), "schemathesis failed:\n{text}");
    let generated: u64 = cases
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(generated >= 500, "only {generated} cases ran:\n{text}");
}

/// Every (status, `error` code) the gateway's source can answer, and every
/// extra field its errors carry, is in docs/openapi-gateway.json: a new
/// refusal without its documentation fails here.
#[test]
fn the_gateway_spec_lists_every_error_the_gateway_answers() {
    let spec: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("docs/openapi-gateway.json")).unwrap(),
    )
    .unwrap();
    let mut documented: BTreeSet<(u16, String)> = BTreeSet::new();
    for ops in spec["paths"].as_object().unwrap().values() {
        for op in ops.as_object().unwrap().values() {
            for (status, response) in op["responses"].as_object().unwrap() {
                let Ok(status) = status.parse::<u16>() else {
                    continue;
                };
                for code in response["x-fencer-error-codes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    documented.insert((status, code.as_str().unwrap().to_owned()));
                }
            }
        }
    }
    let fields = spec["components"]["schemas"]["Error"]["properties"]
        .as_object()
        .unwrap();
    let pair = regex::Regex::new(r#"StatusCode::([A-Z_]+),\s*"([a-z_]+)""#).unwrap();
    let with = regex::Regex::new(r#"\.with\(\s*"([a-z_]+)""#).unwrap();
    let mut found = 0;
    let mut files: Vec<_> = std::fs::read_dir(root().join("src/gateway"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.push(root().join("src/proxy/forward.rs"));
    files.push(root().join("src/proxy/headers.rs"));
    for file in files {
        let src = std::fs::read_to_string(&file).unwrap();
        let mut pairs: Vec<(u16, String)> = pair
            .captures_iter(&src)
            .map(|c| {
                let status = match &c[1] {
                    "BAD_REQUEST" => 400,
                    "FORBIDDEN" => 403,
                    "METHOD_NOT_ALLOWED" => 405,
                    "CONFLICT" => 409,
                    "PRECONDITION_REQUIRED" => 428,
                    "BAD_GATEWAY" => 502,
                    "SERVICE_UNAVAILABLE" => 503,
                    "GATEWAY_TIMEOUT" => 504,
                    other => panic!(
                        "{}: status {other} is not in this test's table",
                        file.display()
                    ),
                };
                (status, c[2].to_owned())
            })
            .collect();
        if src.contains("ApiError::invalid(") {
            pairs.push((400, "invalid_request".into()));
        }
        for p in pairs {
            assert!(
                documented.contains(&p),
                "{}: {p:?} is not in docs/openapi-gateway.json",
                file.display()
            );
            found += 1;
        }
        for c in with.captures_iter(&src) {
            assert!(
                fields.contains_key(&c[1]),
                "{}: error field `{}` is not in the gateway spec's Error schema",
                file.display(),
                &c[1]
            );
        }
    }
    assert!(
        found >= 15,
        "only {found} gateway errors found in the source"
    );
}
