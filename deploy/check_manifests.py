#!/usr/bin/env python3
"""Offline lint of rendered fencer manifests, so manifests and the binary
cannot drift:

* every fencer container's configuration (its ConfigMap file plus its
  FENCER__* environment) is accepted by `fencer check-config` (unknown
  settings, bad values and bad env var names all fail there);
* every named port matches the address the process listens on, and every
  probe path is one the admin listener serves;
* the injector (`fencer inject`, Helm chart): the sidecar it would inject
  into each app namespace (that namespace's sidecar ConfigMap, the
  injector's ports, signing key and gateway URL, the env Secret) passes
  check-config too; the signing Secret it names is there; its gateway URL
  names a Service port that exists;
* the PrometheusRule carries exactly deploy/prometheus/fencer-rules.yaml;
* the dashboards ConfigMap holds every grafana/dashboards/*.json, labelled
  for Grafana's sidecar;
* hardening: no pod mounts a service-account token unless it talks to the
  API server (the trial's credentials Job); no password is a plain `value`;
  every fencer container runs non-root, seccomp RuntimeDefault, read-only
  root, no privilege escalation, ALL capabilities dropped; the sidecar's
  memory limit (a sidecar container's, or the injector's memory_limit)
  leaves room for its max_leases; the injector's own memory limit leaves
  room for its body budget (inject.max_buffered_bytes + 64 MiB); every gateway Deployment has a
  PodDisruptionBudget and no PodDisruptionBudget blocks a node drain; in
  the production overlay every fencer image (the injector's sidecar image
  too) is pinned by digest; in the trial overlay Redis demands a password
  and both backends have a NetworkPolicy.

Objects are told apart by what they run (a fencer container's role, the
first argument after its options; a backend by its image), never by object
name, so the same checks serve the kustomize overlays and the Helm chart
(deploy/check_chart.py imports this module and calls check()).

* every fencer service of the docker-compose file passes check-config
  with its environment.

usage: check_manifests.py RENDERED.yaml FENCER_BINARY [production|trial]
       check_manifests.py --compose docker-compose.yaml FENCER_BINARY
"""
import base64
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
ADMIN_PATHS = {"/healthz", "/readyz", "/metrics"}
# Stand-ins for secret values: well-formed, never used to connect.
SECRET_VALUES = {
    "redis-url": "redis://redis.invalid:6379/0",
    "postgres-url": "postgres://fencer@postgres.invalid:5432/fencer",
}
LISTEN_VARS = {
    "sidecar": {"metrics": "FENCER__ADMIN__LISTEN"},
    "gateway": {"metrics": "FENCER__ADMIN__LISTEN", "http": "FENCER__GATEWAY__LISTEN"},
    "storage": {"http": "FENCER__STORAGE__LISTEN"},
    "inject": {"metrics": "FENCER__ADMIN__LISTEN", "https": "FENCER__INJECT__LISTEN"},
}

errors = []


def fail(msg):
    errors.append(msg)


# Memory of an idle sidecar, and budget per lease (measured ~750 bytes,
# docs/performance.md), for the limit check.
IDLE_MIB = 32
LEASE_BYTES = 1024
DEFAULT_MAX_LEASES = 200_000
# The injector outside its body budget (inject.max_buffered_bytes): the
# process (~22 MiB: 12 MiB anonymous measured, the binary's pages) and up to
# 256 connections' TLS and HTTP buffers (~100 KiB each), with room to spare.
INJECT_BASE_MIB = 64
INJECT_DEFAULT_BUDGET_MIB = 32


def mib(quantity):
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    for u, f in units.items():
        if quantity.endswith(u):
            return float(quantity[: -len(u)]) * f
    return float(quantity) / (1 << 20)


def ns_of(d):
    return d["metadata"].get("namespace", "")


def fencer_containers(d):
    """(container, role) of every fencer container of a Deployment/Job."""
    spec = d["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        if c.get("image", "").split("/")[-1].startswith("fencer") and c.get("args"):
            yield c, c["args"][-1]


def selects(selector, labels):
    """Does a matchLabels selector pick a pod with these labels?"""
    match = (selector or {}).get("matchLabels", {})
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def config_text(d, c, configmaps):
    """The --config file of a fencer container, from its ConfigMap mount."""
    args = c.get("args", [])
    if "--config" not in args:
        return None
    path = args[args.index("--config") + 1]
    volumes = {v["name"]: v for v in d["spec"]["template"]["spec"].get("volumes", [])}
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == path)
    cm = configmaps[(ns_of(d), volumes[mount["name"]]["configMap"]["name"])]
    return cm["data"][mount["subPath"]]


def max_leases(text):
    leases = DEFAULT_MAX_LEASES
    for line in (text or "").splitlines():
        if line.strip().startswith("max_leases"):
            leases = int(line.split("=")[1].split("#")[0].strip().replace("_", ""))
    return leases


def check_memory(where, limit, text):
    leases = max_leases(text)
    need = IDLE_MIB + leases * LEASE_BYTES / (1 << 20)
    if limit is None or mib(limit) < need:
        fail(f"{where}: memory limit {limit} below {need:.0f}Mi for max_leases = {leases}")


def hardening(docs, configmaps, overlay):
    pods = [d for d in docs if d["kind"] in ("Deployment", "Job")]
    for d in pods:
        name = d["metadata"]["name"]
        spec = d["spec"]["template"]["spec"]
        if spec.get("automountServiceAccountToken") is not False and d["kind"] != "Job":
            fail(f"{name}: automountServiceAccountToken must be false")
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            for e in c.get("env", []):
                # A *_FILE variable names where a Secret is mounted.
                if "PASSWORD" in e["name"] and "value" in e and not e["name"].endswith("_FILE"):
                    fail(f"{name}/{c['name']}: {e['name']} is a plain value, not a secret")
            image = c.get("image", "")
            if overlay == "production" and image.split("/")[-1].startswith("fencer"):
                if "@sha256:" not in image:
                    fail(f"{name}/{c['name']}: production image {image} is not pinned by digest")
        for c, role in fencer_containers(d):
            where = f"{name}/{c['name']}"
            psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
            if not (csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
                fail(f"{where}: runAsNonRoot is not set")
            seccomp = csc.get("seccompProfile", psc.get("seccompProfile", {}))
            if seccomp.get("type") != "RuntimeDefault":
                fail(f"{where}: no RuntimeDefault seccomp profile")
            if csc.get("allowPrivilegeEscalation") is not False:
                fail(f"{where}: allowPrivilegeEscalation is not false")
            if csc.get("readOnlyRootFilesystem") is not True:
                fail(f"{where}: root filesystem is writable")
            if "ALL" not in csc.get("capabilities", {}).get("drop", []):
                fail(f"{where}: capabilities are not all dropped")
            if role == "sidecar":
                limit = c.get("resources", {}).get("limits", {}).get("memory")
                check_memory(where, limit, config_text(d, c, configmaps))
            if role == "inject":
                inject = tomllib.loads(config_text(d, c, configmaps)).get("inject", {})
                # Its own limit: the body budget plus what is outside it.
                budget = inject.get("max_buffered_bytes", INJECT_DEFAULT_BUDGET_MIB << 20) / (1 << 20)
                limit = c.get("resources", {}).get("limits", {}).get("memory")
                if limit is None or mib(limit) < budget + INJECT_BASE_MIB:
                    fail(f"{where}: memory limit {limit} below {budget + INJECT_BASE_MIB:.0f}Mi: "
                         f"inject.max_buffered_bytes ({budget:.0f} MiB) + {INJECT_BASE_MIB} MiB")
                # The sidecars it injects get the [inject] memory_limit; they
                # read the sidecar ConfigMap of their own namespace.
                sidecar_cms = [cm for (ns, n), cm in configmaps.items() if n == inject.get("config_map", "fencer-sidecar-config")]
                for cm in sidecar_cms or [None]:
                    at = f" (sidecars in {ns_of(cm)})" if cm else ""
                    check_memory(f"{where}: inject.memory_limit{at}", inject.get("memory_limit"), cm and cm["data"].get("fencer.toml"))
                if overlay == "production" and "@sha256:" not in inject.get("image", ""):
                    fail(f"{where}: production sidecar image {inject.get('image')} is not pinned by digest")
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for d in [d for d in docs if d["kind"] == "Deployment"]:
        labels = d["spec"]["template"]["metadata"].get("labels", {})
        match = [p for p in pdbs if ns_of(p) == ns_of(d) and selects(p["spec"]["selector"], labels)]
        name = d["metadata"]["name"]
        if not match and any(role == "gateway" for _, role in fencer_containers(d)):
            fail(f"{name} (a gateway) has no PodDisruptionBudget")
        for p in match:
            if p["spec"].get("minAvailable", 0) >= d["spec"].get("replicas", 1) or p["spec"].get("maxUnavailable") == 0:
                fail(f"the PodDisruptionBudget of {name} lets no replica go (node drains block)")
    if overlay == "trial":
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        for backend in ("redis", "postgres"):
            deployments = [d for d in docs if d["kind"] == "Deployment" and any(
                c.get("image", "").split("/")[-1].split(":")[0] == backend
                for c in d["spec"]["template"]["spec"]["containers"])]
            if not deployments:
                fail(f"trial: no {backend} Deployment")
            for dep in deployments:
                labels = dep["spec"]["template"]["metadata"].get("labels", {})
                if not any(ns_of(p) == ns_of(dep) and selects(p["spec"]["podSelector"], labels) for p in policies):
                    fail(f"trial: no NetworkPolicy for {backend}")
                if backend == "redis" and "--requirepass" not in dep["spec"]["template"]["spec"]["containers"][0].get("args", []):
                    fail("trial: Redis accepts clients without a password")


def secret_data(secret):
    """A Secret's values as text (data decoded, stringData as is)."""
    out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    out.update(secret.get("stringData") or {})
    return out


@functools.cache
def check_config_args(binary):
    """`check-config` plus `--no-files` where the binary has it: the
    secret and certificate files a manifest names are mounted in the
    cluster, not here (a binary from before the flag did not read them)."""
    out = subprocess.run([binary, "check-config", "--help"], capture_output=True, text=True)
    return ["check-config"] + (["--no-files"] if "--no-files" in out.stdout else [])


def run_check_config(where, binary, env, text=None):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [binary]
        if text is not None:
            cfg = pathlib.Path(tmp, "fencer.toml")
            cfg.write_text(text)
            cmd += ["--config", str(cfg)]
        cmd += check_config_args(binary)
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("FENCER")}
        run_env.update(env)
        out = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
        if out.returncode != 0:
            fail(f"{where}: fencer check-config rejects its configuration: {out.stderr.strip()}")


def injected_sidecars(docs, d, c, configmaps, binary):
    """The sidecar the injector `c` of Deployment `d` would add, in every
    namespace that has its ConfigMap: the environment mirrors
    src/inject/mutate.rs (loopback lock API and proxy, admin port, signing
    key file, gateway URL) plus the env Secret; the file is that
    namespace's ConfigMap. Returns how many were checked."""
    inject = tomllib.loads(config_text(d, c, configmaps)).get("inject", {})
    cm_name = inject.get("config_map", "fencer-sidecar-config")
    secrets = {(ns_of(s), s["metadata"]["name"]): s for s in docs if s["kind"] == "Secret"}
    services = {(ns_of(s), s["metadata"]["name"]): s for s in docs if s["kind"] == "Service"}
    where0 = f'{d["metadata"]["name"]}/{c["name"]}'
    gateway = inject.get("gateway_url", "")
    if gateway:
        # http://<service>.<namespace>.svc:<port>
        host, _, port = gateway.split("://", 1)[-1].rstrip("/").partition(":")
        parts = host.split(".")
        svc = services.get((parts[1] if len(parts) > 1 else ns_of(d), parts[0]))
        if svc is None or not any(str(p["port"]) == (port or "80") for p in svc["spec"]["ports"]):
            fail(f"{where0}: inject.gateway_url {gateway} names no Service port")
    key_id = inject.get("signing_key_id", "k1")
    checked = 0
    for (ns, name), cm in configmaps.items():
        if name != cm_name:
            continue
        where = f"{where0}: sidecar injected in {ns}"
        env = {
            "FENCER__SIDECAR__LISTEN": f"127.0.0.1:{inject.get('lock_api_port', 7411)}",
            "FENCER__PROXY__LISTEN": f"127.0.0.1:{inject.get('proxy_port', 7412)}",
            "FENCER__ADMIN__LISTEN": f"0.0.0.0:{inject.get('admin_port', 9411)}",
            "FENCER__SIGNING__KEY_ID": key_id,
            "FENCER__SIGNING__SECRET_FILE": f"/etc/fencer/signing/{key_id}",
        }
        if gateway:
            env["FENCER__PROXY__UPSTREAM"] = gateway.rstrip("/")
            env["FENCER__SIDECAR__PREREGISTER_URL"] = gateway.rstrip("/") + "/_fencer/v1/fences/"
        signing = secrets.get((ns, inject.get("signing_secret", "fencer-signing")))
        if signing is not None and key_id not in secret_data(signing):
            fail(f"{where}: signing Secret has no key {key_id}")
        env_secret = secrets.get((ns, inject.get("env_secret", "")))
        if env_secret is not None:
            for k, v in secret_data(env_secret).items():
                if not k.startswith("FENCER__"):
                    fail(f"{where}: env Secret key {k} is not a FENCER__ variable")
                env[k] = v
        run_check_config(where, binary, env, cm["data"].get("fencer.toml"))
        checked += 1
    return checked


def check(docs, binary, overlay=None, require_monitoring=True, skip_check_config=()):
    """Every check on already-parsed objects; failures go to `errors`.
    require_monitoring: a PrometheusRule and a dashboards ConfigMap must be
    there (the kustomize base always has them; the chart only when enabled).
    skip_check_config: roles whose check-config is skipped (a binary that
    predates them). Returns the number of fencer containers checked."""
    configmaps = {(ns_of(d), d["metadata"]["name"]): d for d in docs if d["kind"] == "ConfigMap"}
    checked = 0
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for c, role in fencer_containers(d):
            where = f'{d["metadata"]["name"]}/{c["name"]}'
            env = {}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = e["value"]
                else:
                    key = e["valueFrom"]["secretKeyRef"]["key"]
                    env[e["name"]] = SECRET_VALUES.get(key, "x")
            if role not in skip_check_config:
                run_check_config(where, binary, env, config_text(d, c, configmaps))
            if role == "inject" and "sidecar" not in skip_check_config:
                checked += injected_sidecars(docs, d, c, configmaps, binary)
            for port in c.get("ports", []):
                var = LISTEN_VARS.get(role, {}).get(port.get("name"))
                if var is None:
                    fail(f"{where}: port {port.get('name')} is not a listener of the {role} role")
                    continue
                listen = env.get(var)
                if listen is None or not listen.endswith(f':{port["containerPort"]}'):
                    fail(f"{where}: port {port['name']}={port['containerPort']} but {var}={listen}")
            names = {p.get("name") for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if p and "httpGet" in p:
                    path = p["httpGet"]["path"]
                    allowed = ADMIN_PATHS if role != "storage" else {"/healthz"}
                    if path not in allowed:
                        fail(f"{where}: {probe} path {path} is not served")
                    port = p["httpGet"]["port"]
                    if isinstance(port, str) and port not in names:
                        fail(f"{where}: {probe} port {port} is not a port of the container")
                    # /healthz and /readyz live on the admin listener only
                    # (the storage serves its own /healthz on its port).
                    admin = "metrics" if isinstance(port, str) else int(env.get("FENCER__ADMIN__LISTEN", ":0").rsplit(":", 1)[1])
                    if role != "storage" and port != admin:
                        fail(f"{where}: {probe} does not probe the admin listener (port {port})")
            checked += 1
    if checked == 0:
        fail("no fencer container found")

    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    want = yaml.safe_load(open(ROOT / "deploy/prometheus/fencer-rules.yaml"))
    for r in rules:
        if r["spec"] != want:
            fail("PrometheusRule differs from deploy/prometheus/fencer-rules.yaml")
    if not rules and require_monitoring:
        fail("no PrometheusRule")

    hardening(docs, configmaps, overlay)

    dashboards = [d for d in configmaps.values() if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    if not dashboards and require_monitoring:
        fail("dashboards ConfigMap missing or not labelled grafana_dashboard")
    for dash in dashboards:
        for f in (ROOT / "grafana/dashboards").glob("*.json"):
            if json.loads(dash["data"].get(f.name, "null")) != json.load(open(f)):
                fail(f"dashboards ConfigMap lacks {f.name}")
        extra = set(dash["data"]) - {f.name for f in (ROOT / "grafana/dashboards").glob("*.json")}
        if extra:
            fail(f"dashboards ConfigMap has {sorted(extra)} that grafana/dashboards lacks")
    return checked


def main(rendered, binary, overlay=None):
    docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
    checked = check(docs, binary, overlay)
    for e in errors:
        print("ERROR", e)
    print(f"{checked} fencer containers checked")
    return 1 if errors else 0


def check_config(where, binary, env):
    run_check_config(where, binary, env)


def compose(path, binary):
    doc = yaml.safe_load(open(path))
    checked = 0
    for name, svc in doc["services"].items():
        if not svc.get("image", "").startswith("fencer"):
            continue
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        check_config(f"compose/{name}", binary, env)
        checked += 1
    for e in errors:
        print("ERROR", e)
    print(f"{checked} fencer services checked")
    return 1 if errors or checked == 0 else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compose":
        sys.exit(compose(sys.argv[2], sys.argv[3]))
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None))
