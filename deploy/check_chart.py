#!/usr/bin/env python3
"""Offline checks of the Helm chart deploy/helm/fencer, so the chart, its
values schema and the binary cannot drift apart.

Why: a chart is templates — a typo, a wrong indentation or a value the
binary no longer accepts shows only when someone installs it. This renders
it the way `helm install` would (Helm v4 SDK via helm_python, no cluster)
for every values file in deploy/helm/fencer/ci/ and checks:

* the values pass values.schema.json, and `helm lint --strict` (Kubernetes
  1.29) reports no error and no warning;
* every rendered object passes `kubernetes-validate --strict` against the
  Kubernetes 1.29 schemas (custom resources of the Prometheus Operator and
  cert-manager have no schema offline: warned only);
* every check of deploy/check_manifests.py (imported): each fencer
  container's configuration passes `fencer check-config` — the injector's
  [inject] section and the sidecar it would inject into each app namespace
  included —, named ports match the listen addresses, probe paths exist,
  PrometheusRule and dashboards equal deploy/prometheus and grafana/,
  hardening, a PodDisruptionBudget that lets a node drain, the trial's
  password-protected Redis and backend NetworkPolicies;
* every object carries the standard labels (app.kubernetes.io/{name,
  instance,version,managed-by,part-of,component}, helm.sh/chart);
* with production values every fencer image is pinned by digest;
* the webhook: service, path /mutate, port 443, sideEffects None, v1
  reviews, pods CREATE, timeout <= 10 s, system and release namespaces
  excluded; in tls.mode generate its caBundle is non-empty, the TLS
  Secret's certificate verifies against it (openssl verify) and names the
  Service's DNS names; rendering twice gives a valid chart each time;
* the injector's NetworkPolicy admits the webhook port 8443 from exactly
  networkPolicy.webhookFrom (any source when empty) and the injector's
  body timeout is the webhook's timeoutSeconds;
* the per-namespace objects (sidecar ConfigMap, signing Secret with one
  key for all namespaces, env Secret) are in every injector namespace;
  every ConfigMap and Secret a pod uses is rendered or named in the values;
* the schema rejects a misspelt key and an unknown enum value.

usage: check_chart.py --binary target/debug/fencer [--emit DIR]

--emit DIR writes, per values file, DIR/<values>/injector.toml (the
injector ConfigMap's fencer.toml) and DIR/<values>/sidecar.<namespace>.toml
(each app namespace's sidecar ConfigMap), for tests of the injector.
Exit status 1 with ERROR lines when anything fails.
"""
import argparse
import base64
import pathlib
import subprocess
import sys
import tempfile
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/fencer"
sys.path.insert(0, str(ROOT / "deploy"))
import check_manifests  # noqa: E402

import helm_python  # noqa: E402

RELEASE = "fencer"
NAMESPACE = "fencer"
KUBE_VERSION = "1.29.0"
LABELS = [
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/component",
    "helm.sh/chart",
]
SEVERITY = {1: "INFO", 2: "WARNING", 3: "ERROR"}

errors = []


def fail(msg):
    errors.append(msg)


def render(chart, values):
    """{template: text} as `helm install fencer -n fencer` would render."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return {k: v for k, v in sorted(out.items()) if not k.endswith("NOTES.txt")}


def documents(rendered):
    return [d for text in rendered.values() for d in yaml.safe_load_all(text) if d]


def kube_validate(where, path):
    out = subprocess.run(
        ["kubernetes-validate", "--strict", "-k", KUBE_VERSION, "--quiet", str(path)],
        capture_output=True,
        text=True,
    )
    bad = [l for l in (out.stdout + out.stderr).splitlines() if l.strip() and not l.startswith("WARN")]
    if out.returncode != 0 or bad:
        fail(f"{where}: kubernetes-validate: " + ("\n".join(bad) or f"exit {out.returncode}"))


def check_labels(where, docs):
    for d in docs:
        labels = d["metadata"].get("labels", {})
        missing = [l for l in LABELS if not labels.get(l)]
        if missing:
            fail(f"{where}: {d['kind']} {d['metadata']['name']} lacks labels {missing}")
        elif labels["app.kubernetes.io/part-of"] != "fencer":
            fail(f"{where}: {d['kind']} {d['metadata']['name']} is not part-of fencer")
        cluster_scoped = d["kind"] == "MutatingWebhookConfiguration"
        if not cluster_scoped and not d["metadata"].get("namespace"):
            fail(f"{where}: {d['kind']} {d['metadata']['name']} has no explicit namespace")
        if d["kind"] in ("Deployment",):
            pod = d["spec"]["template"]["metadata"].get("labels", {})
            if [l for l in LABELS if not pod.get(l)]:
                fail(f"{where}: pods of {d['metadata']['name']} lack the standard labels")


def kinds(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def check_webhook(where, docs, values):
    hooks = kinds(docs, "MutatingWebhookConfiguration")
    injector = values.get("injector", {}).get("enabled", True)
    if not injector:
        if hooks:
            fail(f"{where}: injector disabled but a webhook is rendered")
        return
    if len(hooks) != 1 or len(hooks[0]["webhooks"]) != 1:
        fail(f"{where}: want one MutatingWebhookConfiguration with one webhook")
        return
    w = hooks[0]["webhooks"][0]
    svc_ref = w["clientConfig"]["service"]
    services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in kinds(docs, "Service")}
    svc = services.get((svc_ref["namespace"], svc_ref["name"]))
    if svc is None or not any(p["port"] == svc_ref.get("port") and p["targetPort"] == "https" for p in svc["spec"]["ports"]):
        fail(f"{where}: webhook service {svc_ref} is no Service port 443 -> https")
    want = {
        "name": "inject.fencer.dev",
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "reinvocationPolicy": "IfNeeded",
        "failurePolicy": values.get("injector", {}).get("failurePolicy", "Ignore"),
    }
    for k, v in want.items():
        if w.get(k) != v:
            fail(f"{where}: webhook {k} is {w.get(k)!r}, want {v!r}")
    if svc_ref.get("path") != "/mutate" or svc_ref.get("port") != 443:
        fail(f"{where}: webhook path/port {svc_ref.get('path')}:{svc_ref.get('port')}, want /mutate:443")
    if not 1 <= w.get("timeoutSeconds", 0) <= 10:
        fail(f"{where}: webhook timeoutSeconds {w.get('timeoutSeconds')} not in 1..10")
    rules = w.get("rules", [])
    if rules != [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced"}]:
        fail(f"{where}: webhook rules {rules} are not pods CREATE")
    excluded = set()
    for e in w.get("namespaceSelector", {}).get("matchExpressions", []):
        if e["key"] == "kubernetes.io/metadata.name" and e["operator"] == "NotIn":
            excluded |= set(e["values"])
    for ns in ("kube-system", "kube-node-lease", "kube-public", NAMESPACE):
        if ns not in excluded:
            fail(f"{where}: the webhook does not exclude namespace {ns}")
    mode = values.get("injector", {}).get("tls", {}).get("mode", "generate")
    ca = w["clientConfig"].get("caBundle", "")
    if mode == "certManager":
        ann = hooks[0]["metadata"].get("annotations", {}).get("cert-manager.io/inject-ca-from")
        certs = {f"{c['metadata']['namespace']}/{c['metadata']['name']}" for c in kinds(docs, "Certificate")}
        if ann not in certs:
            fail(f"{where}: cert-manager.io/inject-ca-from {ann} names no Certificate")
    elif mode == "generate":
        check_generated_tls(where, docs, svc_ref, ca)
    elif not ca:
        fail(f"{where}: tls.mode secret without caBundle")


def check_injector_bounds(where, docs, values):
    """The webhook port is open to networkPolicy.webhookFrom only, and the
    injector gives up on a body when the API server gives up on it."""
    inj = values.get("injector", {})
    np = values.get("networkPolicy", {})
    if not inj.get("enabled", True):
        return
    if np.get("enabled", True):
        policies = [p for p in kinds(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-injector")]
        rules = [r for p in policies for r in p["spec"].get("ingress", [])
                 if any(port.get("port") == 8443 for port in r.get("ports", []))]
        if len(rules) != 1:
            fail(f"{where}: want one ingress rule for the webhook port 8443, got {rules}")
        elif rules[0].get("from", []) != np.get("webhookFrom", []):
            fail(f"{where}: webhook port 8443 admits {rules[0].get('from', 'any source')}, "
                 f"want networkPolicy.webhookFrom {np.get('webhookFrom', [])}")
    for c in kinds(docs, "ConfigMap"):
        if c["metadata"]["name"].endswith("-injector-config"):
            inject = tomllib.loads(c["data"]["fencer.toml"])["inject"]
            want = inj.get("timeoutSeconds", 5) * 1000
            if inject.get("body_timeout_ms") != want:
                fail(f"{where}: inject.body_timeout_ms {inject.get('body_timeout_ms')}, want timeoutSeconds = {want} ms")


def check_generated_tls(where, docs, svc_ref, ca):
    """The Secret's certificate verifies against the webhook's caBundle and
    names the Service's DNS names."""
    if not ca:
        fail(f"{where}: the webhook's caBundle is empty in tls.mode generate")
        return
    dep = next((d for d in kinds(docs, "Deployment") if any(r == "inject" for _, r in check_manifests.fencer_containers(d))), None)
    vol = next((v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"), None) if dep else None
    secrets = {s["metadata"]["name"]: s for s in kinds(docs, "Secret") if s["metadata"]["namespace"] == NAMESPACE}
    secret = secrets.get(vol["secret"]["secretName"]) if vol else None
    if secret is None:
        fail(f"{where}: the injector's TLS Secret is not rendered")
        return
    data = check_manifests.secret_data(secret)
    with tempfile.TemporaryDirectory() as tmp:
        ca_file, crt_file = pathlib.Path(tmp, "ca.pem"), pathlib.Path(tmp, "tls.crt")
        ca_file.write_bytes(base64.b64decode(ca))
        crt_file.write_text(data.get("tls.crt", ""))
        out = subprocess.run(["openssl", "verify", "-CAfile", str(ca_file), str(crt_file)], capture_output=True, text=True)
        if out.returncode != 0:
            fail(f"{where}: the TLS certificate does not verify against caBundle: {out.stdout}{out.stderr}")
        text = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(crt_file)], capture_output=True, text=True).stdout
        for name in (f"{svc_ref['name']}.{svc_ref['namespace']}.svc", f"{svc_ref['name']}.{svc_ref['namespace']}.svc.cluster.local"):
            if f"DNS:{name}" not in text:
                fail(f"{where}: the TLS certificate does not name {name}")
        key_file = pathlib.Path(tmp, "tls.key")
        key_file.write_text(data.get("tls.key", ""))
        pub = [subprocess.run(cmd, capture_output=True, text=True).stdout for cmd in (
            ["openssl", "x509", "-noout", "-pubkey", "-in", str(crt_file)],
            ["openssl", "pkey", "-pubout", "-in", str(key_file)],
        )]
        if not pub[0] or pub[0] != pub[1]:
            fail(f"{where}: tls.key does not belong to tls.crt")


def check_app_namespaces(where, docs, values):
    """Each app namespace gets the sidecar ConfigMap, the signing Secret
    (one key everywhere) and, when the chart writes it, the env Secret."""
    inj = values.get("injector", {})
    if not inj.get("enabled", True):
        return
    signing = values.get("signing", {})
    secret_name = signing.get("existingSecret") or signing.get("secretName", "fencer-signing")
    key_id = signing.get("keyId", "k1")
    by = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs}
    keys = set()
    for s in kinds(docs, "Secret"):
        if s["metadata"]["name"] == secret_name:
            keys.add(check_manifests.secret_data(s).get(key_id))
            if s["metadata"].get("annotations", {}).get("helm.sh/resource-policy") != "keep":
                fail(f"{where}: signing Secret in {s['metadata']['namespace']} is not kept on uninstall")
    if len(keys) > 1:
        fail(f"{where}: the signing Secret copies hold {len(keys)} different keys")
    env_written = bool(values.get("sidecar", {}).get("env")) or values.get("trial", {}).get("enabled", False)
    for ns in inj.get("namespaces", []):
        if ("ConfigMap", ns, "fencer-sidecar-config") not in by:
            fail(f"{where}: no sidecar ConfigMap in {ns}")
        if not signing.get("existingSecret") and ("Secret", ns, secret_name) not in by:
            fail(f"{where}: no signing Secret in {ns}")
        if env_written and ("Secret", ns, "fencer-sidecar-env") not in by:
            fail(f"{where}: no fencer-sidecar-env Secret in {ns}")
    if not signing.get("existingSecret") and ("Secret", NAMESPACE, secret_name) not in by:
        fail(f"{where}: no signing Secret for the gateway")


def check_references(where, docs, values):
    """Every ConfigMap and Secret a pod mounts or reads is rendered in its
    namespace, or is one the values say exists already (or cert-manager
    writes)."""
    external = {
        values.get("signing", {}).get("existingSecret"),
        values.get("gateway", {}).get("postgres", {}).get("existingSecret", "fencer-backend") if not values.get("trial", {}).get("enabled") else None,
        values.get("injector", {}).get("tls", {}).get("secretName"),
        values.get("gateway", {}).get("etcd", {}).get("existingSecret"),
    } | {c["spec"]["secretName"] for c in kinds(docs, "Certificate")}
    have = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}
    for d in kinds(docs, "Deployment"):
        ns, spec = d["metadata"]["namespace"], d["spec"]["template"]["spec"]
        refs = [("ConfigMap", v["configMap"]["name"]) for v in spec.get("volumes", []) if "configMap" in v]
        refs += [("Secret", v["secret"]["secretName"]) for v in spec.get("volumes", []) if "secret" in v]
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            refs += [("Secret", e["valueFrom"]["secretKeyRef"]["name"]) for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
        for kind, name in refs:
            if (kind, ns, name) not in have and name not in external:
                fail(f"{where}: {d['metadata']['name']} uses {kind} {ns}/{name}, which is neither rendered nor given in the values")


def check_monitoring(where, docs, values):
    mon = values.get("monitoring", {})
    want = {
        "PodMonitor": mon.get("podMonitor", {}).get("enabled", False),
        "ServiceMonitor": mon.get("serviceMonitor", {}).get("enabled", False),
        "PrometheusRule": mon.get("prometheusRule", {}).get("enabled", False),
    }
    for kind, on in want.items():
        if bool(kinds(docs, kind)) != on:
            fail(f"{where}: {kind} {'missing' if on else 'rendered though disabled'}")
    for pm in kinds(docs, "PodMonitor"):
        if pm["spec"]["selector"].get("matchLabels") != {"fencer.dev/sidecar": "true"}:
            fail(f"{where}: PodMonitor does not select fencer.dev/sidecar pods")
        if [e.get("port") for e in pm["spec"]["podMetricsEndpoints"]] != ["fencer-metrics"]:
            fail(f"{where}: PodMonitor does not scrape the injected port fencer-metrics")
    dash = mon.get("dashboards", {}).get("enabled", True)
    if dash != any(c["metadata"].get("labels", {}).get("grafana_dashboard") == "1" for c in kinds(docs, "ConfigMap")):
        fail(f"{where}: dashboards ConfigMap {'missing' if dash else 'rendered though disabled'}")


def check_production(where, docs):
    for d in kinds(docs, "Deployment"):
        for c, _ in check_manifests.fencer_containers(d):
            if "@sha256:" not in c["image"]:
                fail(f"{where}: {d['metadata']['name']}/{c['name']} image {c['image']} is not pinned by digest")


def emit(directory, name, docs):
    out = pathlib.Path(directory, name)
    out.mkdir(parents=True, exist_ok=True)
    for c in kinds(docs, "ConfigMap"):
        ns, n = c["metadata"]["namespace"], c["metadata"]["name"]
        if n.endswith("-injector-config"):
            (out / "injector.toml").write_text(c["data"]["fencer.toml"])
        elif n == "fencer-sidecar-config":
            (out / f"sidecar.{ns}.toml").write_text(c["data"]["fencer.toml"])


def check_schema(chart):
    for bad, what in (({"gatewy": {}}, "a misspelt key"), ({"injector": {"tls": {"mode": "bogus"}}}, "an unknown tls.mode"),
                      ({"sidecar": {"env": {"REDIS_URL": "x"}}}, "a sidecar.env name without FENCER__"),
                      ({"injector": {"timeoutSeconds": 30}}, "a webhook timeout above 10 s")):
        try:
            chart.validate_schema(bad)
        except helm_python.HelmError:
            continue
        fail(f"values.schema.json accepts {what}: {bad}")


def check_values_file(chart, path, binary, skip, emit_dir):
    where = path.name
    values = yaml.safe_load(path.read_text()) or {}
    try:
        chart.validate_schema(values)
    except helm_python.HelmError as e:
        fail(f"{where}: values rejected by values.schema.json: {e}")
        return 0
    lint = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    for m in lint.get("messages", []):
        if m["severity"] >= 2:
            fail(f"{where}: helm lint {SEVERITY.get(m['severity'], m['severity'])} {m['path']}: {m['error']}")
    for e in lint.get("errors", []):
        fail(f"{where}: helm lint: {e}")
    mode = values.get("injector", {}).get("tls", {}).get("mode", "generate")
    # In tls.mode generate every render makes a new CA and certificate
    # (lookup finds nothing offline): render twice, check both.
    renders = 2 if mode == "generate" else 1
    count = 0
    for n in range(renders):
        tag = f"{where} (render {n + 1})" if renders > 1 else where
        rendered = render(chart, values)
        docs = documents(rendered)
        count = len(docs)
        with tempfile.TemporaryDirectory() as tmp:
            # The text as rendered (not re-serialized): what kubectl gets.
            file = pathlib.Path(tmp, "rendered.yaml")
            file.write_text("\n---\n".join(rendered.values()))
            kube_validate(tag, file)
        check_labels(tag, docs)
        check_webhook(tag, docs, values)
        if n > 0:
            continue
        check_app_namespaces(tag, docs, values)
        check_injector_bounds(tag, docs, values)
        check_references(tag, docs, values)
        check_monitoring(tag, docs, values)
        overlay = "production" if "production" in path.stem else ("trial" if values.get("trial", {}).get("enabled") else None)
        if overlay == "production":
            check_production(tag, docs)
        before = len(check_manifests.errors)
        checked = check_manifests.check(docs, binary, overlay, require_monitoring=False, skip_check_config=skip)
        for e in check_manifests.errors[before:]:
            fail(f"{tag}: {e}")
        print(f"{where}: {count} objects, {checked} fencer containers checked")
        if emit_dir:
            emit(emit_dir, path.stem, docs)
    return count


def binary_knows_inject(binary):
    """A binary built before `fencer inject` rejects [inject]."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = pathlib.Path(tmp, "fencer.toml")
        cfg.write_text('[inject]\nlisten = "0.0.0.0:8443"\n')
        args = check_manifests.check_config_args(binary)
        return subprocess.run([binary, "--config", str(cfg), *args], capture_output=True).returncode == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", required=True, help="the fencer binary (check-config)")
    ap.add_argument("--emit", metavar="DIR", help="write the rendered injector and sidecar configs here")
    args = ap.parse_args()
    skip = ()
    if not binary_knows_inject(args.binary):
        print("WARNING: this fencer binary does not know [inject]; the injector's check-config is SKIPPED")
        skip = ("inject",)
    chart = helm_python.Chart.load(CHART)
    check_schema(chart)
    files = sorted((CHART / "ci").glob("*.yaml"))
    if not files:
        fail("no values files in deploy/helm/fencer/ci")
    for f in files:
        check_values_file(chart, f, args.binary, skip, args.emit)
    for e in errors:
        print("ERROR", e)
    print("chart OK" if not errors else f"{len(errors)} chart check(s) failed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
