#!/usr/bin/env python3
"""Offline lint of rendered fencer manifests, so manifests and the binary
cannot drift:

* every fencer container's configuration (its ConfigMap file plus its
  FENCER__* environment) is accepted by `fencer check-config` (unknown
  settings, bad values and bad env var names all fail there);
* every named port matches the address the process listens on, and every
  probe path is one the admin listener serves;
* the PrometheusRule carries exactly deploy/prometheus/fencer-rules.yaml;
* the dashboards ConfigMap holds every grafana/dashboards/*.json, labelled
  for Grafana's sidecar;
* hardening: no pod mounts a service-account token unless it talks to the
  API server (the trial's credentials Job); no password is a plain `value`;
  the sidecar's memory limit leaves room for its max_leases; every gateway
  Deployment has a PodDisruptionBudget that lets a node drain; in the
  production overlay every fencer image is pinned by digest; in the trial
  overlay Redis demands a password and both backends have a NetworkPolicy.

* every fencer service of the docker-compose file passes check-config
  with its environment.

usage: check_manifests.py RENDERED.yaml FENCER_BINARY [production|trial]
       check_manifests.py --compose docker-compose.yaml FENCER_BINARY
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

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
}

errors = []


def fail(msg):
    errors.append(msg)


# Memory of an idle sidecar, and budget per lease (measured ~750 bytes,
# docs/performance.md), for the limit check.
IDLE_MIB = 32
LEASE_BYTES = 1024
DEFAULT_MAX_LEASES = 200_000


def mib(quantity):
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    for u, f in units.items():
        if quantity.endswith(u):
            return float(quantity[: -len(u)]) * f
    return float(quantity) / (1 << 20)


def hardening(docs, configmaps, overlay):
    pods = [d for d in docs if d["kind"] in ("Deployment", "Job")]
    for d in pods:
        name = d["metadata"]["name"]
        spec = d["spec"]["template"]["spec"]
        if spec.get("automountServiceAccountToken") is not False and d["kind"] != "Job":
            fail(f"{name}: automountServiceAccountToken must be false")
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            for e in c.get("env", []):
                if "PASSWORD" in e["name"] and "value" in e:
                    fail(f"{name}/{c['name']}: {e['name']} is a plain value, not a secret")
            image = c.get("image", "")
            if overlay == "production" and image.split("/")[-1].startswith("fencer"):
                if "@sha256:" not in image:
                    fail(f"{name}/{c['name']}: production image {image} is not pinned by digest")
            if c.get("args", [])[-1:] == ["sidecar"]:
                limit = c.get("resources", {}).get("limits", {}).get("memory")
                text = ""
                for m in c.get("volumeMounts", []):
                    vol = next(v for v in spec["volumes"] if v["name"] == m["name"])
                    if "configMap" in vol:
                        text = configmaps[vol["configMap"]["name"]]["data"][m["subPath"]]
                leases = DEFAULT_MAX_LEASES
                for line in text.splitlines():
                    if line.strip().startswith("max_leases"):
                        leases = int(line.split("=")[1].split("#")[0].strip().replace("_", ""))
                need = IDLE_MIB + leases * LEASE_BYTES / (1 << 20)
                if limit is None or mib(limit) < need:
                    fail(f"{name}/{c['name']}: memory limit {limit} below {need:.0f}Mi for max_leases = {leases}")
    gateways = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "fencer-gateway"]
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for g in gateways:
        labels = g["spec"]["template"]["metadata"]["labels"]
        match = [p for p in pdbs if all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())]
        if not match:
            fail("fencer-gateway has no PodDisruptionBudget")
        for p in match:
            if p["spec"].get("minAvailable", 0) >= g["spec"].get("replicas", 1):
                fail("the gateway's PodDisruptionBudget lets no replica go (node drains block)")
    if overlay == "trial":
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        for backend in ("redis", "postgres"):
            if not any(p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == backend for p in policies):
                fail(f"trial: no NetworkPolicy for {backend}")
        redis = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "redis")
        if "--requirepass" not in redis["spec"]["template"]["spec"]["containers"][0].get("args", []):
            fail("trial: Redis accepts clients without a password")


def main(rendered, binary, overlay=None):
    docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    checked = 0
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            if not c.get("image", "").split("/")[-1].startswith("fencer"):
                continue
            args = c.get("args", [])
            role = args[-1]
            where = f'{d["metadata"]["name"]}/{c["name"]}'
            env = {}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = e["value"]
                else:
                    key = e["valueFrom"]["secretKeyRef"]["key"]
                    env[e["name"]] = SECRET_VALUES.get(key, "x")
            cmd = [binary]
            with tempfile.TemporaryDirectory() as tmp:
                if "--config" in args:
                    path = args[args.index("--config") + 1]
                    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == path)
                    cm = configmaps[volumes[mount["name"]]["configMap"]["name"]]
                    text = cm["data"][mount["subPath"]]
                    cfg = pathlib.Path(tmp, "fencer.toml")
                    cfg.write_text(text)
                    cmd += ["--config", str(cfg)]
                cmd += ["check-config"]
                run_env = {k: v for k, v in os.environ.items() if not k.startswith("FENCER")}
                run_env.update(env)
                out = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
                if out.returncode != 0:
                    fail(f"{where}: fencer check-config rejects its configuration: {out.stderr.strip()}")
            for port in c.get("ports", []):
                var = LISTEN_VARS.get(role, {}).get(port.get("name"))
                if var is None:
                    fail(f"{where}: port {port.get('name')} is not a listener of the {role} role")
                    continue
                listen = env.get(var)
                if listen is None or not listen.endswith(f':{port["containerPort"]}'):
                    fail(f"{where}: port {port['name']}={port['containerPort']} but {var}={listen}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if p and "httpGet" in p:
                    path = p["httpGet"]["path"]
                    allowed = ADMIN_PATHS if role != "storage" else {"/healthz"}
                    if path not in allowed:
                        fail(f"{where}: {probe} path {path} is not served")
            checked += 1
    if checked == 0:
        fail("no fencer container found")

    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    want = yaml.safe_load(open(ROOT / "deploy/prometheus/fencer-rules.yaml"))
    for r in rules:
        if r["spec"] != want:
            fail("PrometheusRule differs from deploy/prometheus/fencer-rules.yaml")
    if not rules:
        fail("no PrometheusRule")

    hardening(docs, configmaps, overlay)

    dash = configmaps.get("fencer-dashboards")
    if not dash or dash["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
        fail("dashboards ConfigMap missing or not labelled grafana_dashboard")
    else:
        for f in (ROOT / "grafana/dashboards").glob("*.json"):
            if json.loads(dash["data"].get(f.name, "null")) != json.load(open(f)):
                fail(f"dashboards ConfigMap lacks {f.name}")

    for e in errors:
        print("ERROR", e)
    print(f"{checked} fencer containers checked")
    return 1 if errors else 0


def check_config(where, binary, env):
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("FENCER")}
    run_env.update(env)
    out = subprocess.run([binary, "check-config"], env=run_env, capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"{where}: fencer check-config rejects its configuration: {out.stderr.strip()}")


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
