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

/// The chart's injector configuration, given to the real pod change
/// (`fencer::inject::mutate`), injects a sidecar whose environment plus the
/// chart's sidecar ConfigMap for that namespace passes `check-config`, in a
/// pod that validates strictly: the chart and the injector agree on names,
/// ports and the gateway's address, for every values file.
#[test]
fn the_charts_injector_injects_sidecars_the_charts_config_accepts() {
    use fencer::inject::mutate::{mutate, Outcome};
    let emit = tempfile::tempdir().unwrap();
    run(Command::new("python3")
        .arg(root().join("deploy/check_chart.py"))
        .arg("--binary")
        .arg(env!("CARGO_BIN_EXE_fencer"))
        .arg("--emit")
        .arg(emit.path()));
    let review: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/admission/deployment-pod.json"))
            .unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for values in std::fs::read_dir(emit.path()).unwrap() {
        let dir = values.unwrap().path();
        let settings = fencer::settings::Settings::load(Some(&dir.join("injector.toml")))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let Ok(Outcome::Patch(patch)) = mutate(&review["request"]["object"], &settings.inject)
        else {
            panic!("{}: no patch", dir.display());
        };
        let mut pod = review["request"]["object"].clone();
        json_patch::patch(&mut pod, &patch).unwrap();
        let pod_file = dir.join("pod.json");
        std::fs::write(&pod_file, serde_json::to_vec(&pod).unwrap()).unwrap();
        run(Command::new("kubernetes-validate")
            .args(["--strict", "-k", "1.29.0", "--quiet"])
            .arg(&pod_file));
        let sidecar = &pod["spec"]["initContainers"][0];
        assert_eq!(
            sidecar["image"].as_str(),
            Some(settings.inject.image.as_str())
        );
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !(name.starts_with("sidecar.") && name.ends_with(".toml")) {
                continue;
            }
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_fencer"));
            // The Secrets' files are mounted in the pod, not here.
            cmd.arg("--config")
                .arg(&path)
                .args(["check-config", "--no-files"]);
            for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("FENCER")) {
                cmd.env_remove(k);
            }
            for e in sidecar["env"].as_array().unwrap() {
                cmd.env(e["name"].as_str().unwrap(), e["value"].as_str().unwrap());
            }
            // What the env Secret holds (a stand-in, never connected to).
            cmd.env(
                "FENCER__BACKEND__REDIS__URL",
                "redis://redis.invalid:6379/0",
            );
            run(&mut cmd);
            checked += 1;
        }
    }
    // default: no app namespace; trial: 1; production: 2.
    assert!(
        checked >= 3,
        "only {checked} sidecar configurations checked"
    );
}
