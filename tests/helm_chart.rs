//! The Helm chart (deploy/helm/fencer), checked offline by
//! deploy/check_chart.py for every values file in its ci/ directory:
//! values schema, `helm lint --strict`, strict validation against the
//! Kubernetes 1.29 schemas, standard labels, the webhook and its generated
//! certificate, and every check of deploy/check_manifests.py against this
//! binary (`fencer check-config` on the gateway's, the injector's and each
//! injected sidecar's configuration; ports, probes, rules, dashboards,
//! hardening). Needs `helm-python-sdk`, `kubernetes-validate` (pip) and
//! `openssl`.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn helm_chart_renders_lints_validates_and_matches_the_binary() {
    let out = run(Command::new("python3")
        .arg(root().join("deploy/check_chart.py"))
        .arg("--binary")
        .arg(env!("CARGO_BIN_EXE_fencer")));
    assert!(out.contains("chart OK"), "{out}");
}
