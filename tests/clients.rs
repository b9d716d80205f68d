//! The client libraries (`clients/python`, `clients/node`) against `fencer dev`.
//!
//! Each library's own tests (Python `unittest`, `node --test`) run against a
//! `fencer dev` this binary starts, with `FENCER_API`, `FENCER_PROXY`,
//! `FENCER_GATEWAY` pointing at it and `FENCER_ERROR_CODES` listing every error
//! code fencer can answer — taken from the OpenAPI descriptions and from
//! `src/` here, so a code added to either without a class in the libraries
//! fails their tests. The Node library's hand-written types are checked with
//! `tsc --noEmit --strict`, and both packages are installed from their folder
//! with the ecosystem's own tool (pip, npm), offline.
//!
//! A missing interpreter or tool fails the test, naming what to install.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use common::dev::Dev;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Fails the test, naming what to install, unless `cmd args` runs and exits 0.
fn require(what: &str, install: &str, cmd: &str, args: &[&str]) {
    common::require_tool("the client tests", what, install, cmd, args)
}

/// Runs `cmd` to completion, prints its output and time, asserts exit 0.
fn run(what: &str, cmd: &mut Command) -> String {
    let started = Instant::now();
    let out = cmd
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{:>6.2} s  {what}\n{text}", started.elapsed().as_secs_f64());
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

/// The error codes `docs/openapi*.json` name in their 4xx/5xx answers:
/// backticked words in the descriptions that are not a schema's property.
fn openapi_codes(file: &Path) -> Vec<String> {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let mut properties = std::collections::BTreeSet::new();
    let mut stack = vec![&doc];
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::Object(props)) = map.get("properties") {
                    properties.extend(props.keys().cloned());
                }
                stack.extend(map.values());
            }
            serde_json::Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    // Backticked words that are neither codes nor properties.
    const NOT_CODES: &[&str] = &["limit"];
    let mut codes = Vec::new();
    for op in doc["paths"].as_object().unwrap().values() {
        for op in op.as_object().unwrap().values() {
            let Some(responses) = op.get("responses").and_then(|r| r.as_object()) else {
                continue;
            };
            for (status, response) in responses {
                if !status.starts_with('4') && !status.starts_with('5') {
                    continue;
                }
                let text = response["description"].as_str().unwrap_or_default();
                for (i, word) in text.split('`').enumerate() {
                    let is_word = !word.is_empty()
                        && word.chars().all(|c| c.is_ascii_lowercase() || c == '_');
                    if i % 2 == 1
                        && is_word
                        && !properties.contains(word)
                        && !NOT_CODES.contains(&word)
                    {
                        codes.push(word.to_owned());
                    }
                }
            }
        }
    }
    codes
}

/// The error codes the Rust files under `paths` answer with: every
/// `StatusCode::X, "code"` pair, plus `ApiError`'s shorthands. Folders and
/// files named in `skip` are left out.
fn source_codes(paths: &[&str], skip: &[&str]) -> Vec<String> {
    let mut codes = Vec::new();
    let mut todo: Vec<PathBuf> = paths.iter().map(|p| root().join(p)).collect();
    while let Some(path) = todo.pop() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if skip.contains(&name.as_str()) {
            continue;
        }
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                todo.push(entry.unwrap().path());
            }
            continue;
        }
        if !name.ends_with(".rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (shorthand, code) in [
            ("ApiError::invalid(", "invalid_request"),
            ("ApiError::internal(", "internal_error"),
            ("ApiError::not_found(", "not_found"),
        ] {
            if text.contains(shorthand) {
                codes.push(code.to_owned());
            }
        }
        for part in text.split("StatusCode::").skip(1) {
            let rest = part.trim_start_matches(|c: char| c.is_ascii_uppercase() || c == '_');
            let Some(rest) = rest.trim_start().strip_prefix(',') else {
                continue;
            };
            let Some(rest) = rest.trim_start().strip_prefix('"') else {
                continue;
            };
            let code: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !code.is_empty() && rest[code.len()..].starts_with('"') {
                codes.push(code);
            }
        }
    }
    codes.sort();
    codes.dedup();
    codes
}

/// Copies a source tree (files and folders; no caches).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name == "__pycache__" || name == "build" {
            continue;
        }
        if path.is_dir() {
            copy_tree(&path, &to.join(name));
        } else {
            std::fs::copy(&path, to.join(name)).unwrap();
        }
    }
}

/// Every error code an application can get from fencer (the lock API,
/// proxy and gateway; not the injector, admin listener, demo storage or
/// bench), as JSON.
fn error_codes() -> String {
    let mut codes = source_codes(&["src"], &["inject", "admin.rs", "storage", "bench"]);
    codes.extend(openapi_codes(&root().join("docs/openapi.json")));
    codes.extend(openapi_codes(&root().join("docs/openapi-gateway.json")));
    codes.sort();
    codes.dedup();
    // The extraction itself must keep working.
    for known in [
        "lock_held",
        "lease_lost",
        "lease_required",
        "stale_fencing_token",
        "upstream_timeout",
    ] {
        assert!(
            codes.iter().any(|c| c == known),
            "{known} not found: {codes:?}"
        );
    }
    serde_json::to_string(&codes).unwrap()
}

/// The codes the egress proxy and the gateway answer with themselves, as
/// JSON: the libraries take a fenced answer as fencer's refusal only with
/// one of these (the storage's own answers pass through unchanged).
fn fenced_codes() -> String {
    let mut codes = source_codes(&["src/proxy", "src/gateway", "src/sidecar/egress.rs"], &[]);
    codes.extend(openapi_codes(&root().join("docs/openapi-gateway.json")));
    codes.sort();
    codes.dedup();
    for known in ["lease_required", "stale_fencing_token", "upstream_timeout"] {
        assert!(
            codes.iter().any(|c| c == known),
            "{known} not found: {codes:?}"
        );
    }
    assert!(!codes.iter().any(|c| c == "not_found"), "{codes:?}");
    serde_json::to_string(&codes).unwrap()
}

/// The library's own test command, pointed at a fresh `fencer dev`.
fn against_dev(dev: &Dev, cmd: &mut Command) {
    cmd.current_dir(root())
        .env("FENCER_API", &dev.api)
        .env("FENCER_PROXY", &dev.proxy)
        .env("FENCER_GATEWAY", &dev.gateway)
        .env("FENCER_ERROR_CODES", error_codes())
        .env("FENCER_FENCED_CODES", fenced_codes());
}

#[test]
fn python_client() {
    require(
        "python3 with the requests package",
        "python3 and `pip install requests`",
        "python3",
        &["-c", "import requests"],
    );
    let dev = Dev::start();
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "unittest",
        "discover",
        "-v",
        "-s",
        "clients/python/tests",
    ])
    .env("PYTHONPATH", root().join("clients/python/src"));
    against_dev(&dev, &mut cmd);
    let out = run("python3 -m unittest (clients/python)", &mut cmd);
    assert!(
        !out.contains("skipped"),
        "no test may be skipped here:\n{out}"
    );
}

#[test]
fn node_client() {
    require(
        "Node.js 20.3 or later (fetch, AbortSignal.any)",
        "nodejs (20)",
        "node",
        &[
            "-e",
            "process.exit(typeof AbortSignal.any === 'function' ? 0 : 1)",
        ],
    );
    let dev = Dev::start();
    let mut cmd = Command::new("node");
    cmd.args(["--test", "clients/node/test/"]);
    against_dev(&dev, &mut cmd);
    let out = run("node --test (clients/node)", &mut cmd);
    assert!(
        out.contains("# skipped 0"),
        "no test may be skipped here:\n{out}"
    );
}

/// `tsc`: `$FENCER_TSC`, else the one tests/run.sh installs, else on PATH.
fn tsc() -> String {
    if let Ok(tsc) = std::env::var("FENCER_TSC") {
        return tsc;
    }
    let cached =
        std::env::var("HOME").map(|h| format!("{h}/.cache/fencer-tsc/node_modules/.bin/tsc"));
    match cached {
        Ok(path) if Path::new(&path).exists() => path,
        _ => "tsc".to_owned(),
    }
}

#[test]
fn node_types_check() {
    let tsc = tsc();
    require(
        "TypeScript's tsc",
        "`npm install --prefix ~/.cache/fencer-tsc typescript@5` (tests/run.sh does)",
        &tsc,
        &["--version"],
    );
    run(
        "tsc --noEmit (clients/node/test/types-check.ts)",
        Command::new(&tsc).args([
            "-p",
            root()
                .join("clients/node/test/tsconfig.json")
                .to_str()
                .unwrap(),
        ]),
    );
}

#[test]
fn packages_install_from_their_folders() {
    let dir = tempfile::tempdir().unwrap();
    // pip: from the folder, without the network (the build backend is the
    // machine's setuptools), into a directory of its own.
    require(
        "python3 with pip, setuptools and wheel (an offline build from the folder)",
        "`pip install setuptools wheel` (tests/run.sh does)",
        "python3",
        &["-c", "import setuptools, wheel"],
    );
    // A copy: building writes build/ and *.egg-info next to the sources.
    let source = dir.path().join("python");
    copy_tree(&root().join("clients/python"), &source);
    let site = dir.path().join("site");
    run(
        "pip install clients/python",
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
            ])
            .arg("--target")
            .arg(&site)
            .arg(&source)
            .current_dir(dir.path()),
    );
    let out = run(
        "import fencer_client (installed)",
        Command::new("python3")
            .args([
                "-c",
                "import fencer_client as f; print(f.__file__, len(f.ERROR_CLASSES))",
            ])
            .env("PYTHONPATH", &site)
            .current_dir(dir.path()),
    );
    assert!(out.contains(site.to_str().unwrap()), "{out}");

    // npm: from the folder into a fresh project.
    let app = dir.path().join("app");
    std::fs::create_dir(&app).unwrap();
    common::clients::install_node_client(&app);
    let out = run(
        "import 'fencer-client' (installed)",
        Command::new("node")
            .args([
                "--input-type=module",
                "-e",
                "import * as f from 'fencer-client'; console.log(typeof f.FencerClient, Object.keys(f.ERROR_CLASSES).length)",
            ])
            .current_dir(&app),
    );
    assert!(out.starts_with("function "), "{out}");
}
