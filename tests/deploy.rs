//! Deployment files, checked offline: every kustomize overlay renders and
//! validates strictly against the Kubernetes 1.29 schemas (native sidecars
//! need 1.29), the manifests' configuration is accepted by the binary, and
//! ports, probes, rules and dashboards match what the binary serves.
//! Needs `kubectl` (for kustomize) and `kubernetes-validate` (pip);
//! tests/run.sh installs both.

use std::path::{Path, PathBuf};
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

fn validate(file: &Path) {
    let out = run(Command::new("kubernetes-validate")
        .args(["--strict", "-k", "1.29.0", "--quiet"])
        .arg(file));
    // Custom resources (Prometheus Operator) have no schema offline: warned,
    // not validated. Everything else must pass.
    let errors: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with("WARN"))
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert!(
        errors.is_empty(),
        "{}: {}",
        file.display(),
        errors.join("\n")
    );
}

#[test]
fn kustomize_overlays_render_validate_and_match_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    for overlay in ["trial", "production"] {
        // Default settings: GitOps tools render kustomize without
        // --load-restrictor, so the base reads only files below it.
        let rendered = run(Command::new("kubectl").args([
            "kustomize",
            root()
                .join("deploy/kustomize/overlays")
                .join(overlay)
                .to_str()
                .unwrap(),
        ]));
        let file: PathBuf = dir.path().join(format!("{overlay}.yaml"));
        std::fs::write(&file, &rendered).unwrap();
        for kind in [
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "ConfigMap",
            "PodMonitor",
            "ServiceMonitor",
            "PrometheusRule",
        ] {
            assert!(
                rendered.contains(&format!("kind: {kind}\n")),
                "{overlay}: no {kind}"
            );
        }
        assert!(
            rendered.contains("restartPolicy: Always"),
            "{overlay}: sidecar is not a native sidecar"
        );
        validate(&file);
        run(Command::new("python3")
            .arg(root().join("deploy/check_manifests.py"))
            .arg(&file)
            .arg(env!("CARGO_BIN_EXE_fencer"))
            .arg(overlay));
    }
    validate(&root().join("deploy/kustomize/secrets.example.yaml"));
}

/// The copies of config/, grafana/dashboards/ and the alert rules that
/// kustomize and the Helm chart read (they cannot read outside their own
/// directories) are byte-equal to their sources, with none left over.
#[test]
fn copies_under_deploy_match_their_sources() {
    run(Command::new("python3")
        .arg(root().join("deploy/sync_copies.py"))
        .arg("--check"));
}

/// The check above fails on a drifted copy (not a check that cannot fail).
#[test]
fn a_drifted_copy_is_caught() {
    let tree = tempfile::tempdir().unwrap();
    for dir in [
        "config",
        "grafana/dashboards",
        "deploy/prometheus",
        "deploy/kustomize/base/files",
        "deploy/helm/fencer/files",
    ] {
        let out = Command::new("cp")
            .args(["-r", "--parents", dir])
            .arg(tree.path())
            .current_dir(root())
            .status()
            .unwrap();
        assert!(out.success());
    }
    std::fs::copy(
        root().join("deploy/sync_copies.py"),
        tree.path().join("deploy/sync_copies.py"),
    )
    .unwrap();
    let check = |what: &str| {
        let out = Command::new("python3")
            .arg(tree.path().join("deploy/sync_copies.py"))
            .arg("--check")
            .output()
            .unwrap();
        (
            out.status.success(),
            format!("{what}: {}", String::from_utf8_lossy(&out.stdout)),
        )
    };
    assert!(check("unchanged").0);
    let sidecar = tree.path().join("config/sidecar.toml");
    let mut text = std::fs::read_to_string(&sidecar).unwrap();
    text.push_str("\n# edited\n");
    std::fs::write(&sidecar, text).unwrap();
    let (ok, out) = check("edited source");
    assert!(
        !ok && out.contains("deploy/kustomize/base/files/sidecar.toml differs"),
        "{out}"
    );
    assert!(
        out.contains("deploy/helm/fencer/files/sidecar.toml differs"),
        "{out}"
    );
}

#[test]
fn compose_services_are_valid_fencer_configurations() {
    run(Command::new("python3")
        .arg(root().join("deploy/check_manifests.py"))
        .arg("--compose")
        .arg(root().join("deploy/compose/docker-compose.yaml"))
        .arg(env!("CARGO_BIN_EXE_fencer")));
}
