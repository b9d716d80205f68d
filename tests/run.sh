#!/usr/bin/env bash
# Runs every test of fencer on a fresh machine: installs the services the
# tests start for themselves (they never use the machine's own instances),
# then runs the unit, integration and fault tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# Where the time goes (issue 29): each phase's wall time, each test
# binary's and each fault run's, printed as a table at the end — by .ci/run
# when it runs us, else by us.
if [ -z "${FENCER_CI_DIR:-}" ]; then
  FENCER_CI_DIR="$(mktemp -d)"
  export FENCER_CI_DIR
  run_start=$(date +%s)
  trap 'python3 tests/ci_times.py "$FENCER_CI_DIR/phases" "$run_start" "$FENCER_CI_DIR/cargo-test.log" "$FENCER_CI_DIR/faults.log"' EXIT
fi
timed() {
  local name=$1 t0 rc=0
  shift
  t0=$(date +%s)
  "$@" || rc=$?
  echo "$name $(( $(date +%s) - t0 ))" >> "$FENCER_CI_DIR/phases"
  return $rc
}

install_start=$(date +%s)
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || need+=(faketime)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v kubectl >/dev/null 2>&1 || need+=(kubectl)
ls /usr/share/java/zookeeper.jar >/dev/null 2>&1 || need+=(zookeeper)   # the ZooKeeper backend's own test servers
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)   # the etcd backend's own test members (issue 34)
{ command -v mariadbd && command -v mariadb-install-db && command -v mariadb; } >/dev/null 2>&1 || need+=(mariadb-server mariadb-client)   # the MySQL backend's own test servers
[ -x /usr/sbin/nginx ] || need+=(nginx)   # fencer bench's write-path comparison
# The client examples (tests/examples.rs) in Node, Java and shell.
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v javac >/dev/null 2>&1 || need+=(default-jdk-headless)
command -v jq >/dev/null 2>&1 || need+=(jq)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing: ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# Offline Kubernetes schema validation (tests/deploy.rs, tests/inject.rs)
# and the Helm chart's render and lint through Helm's own Go SDK, packaged
# for Python (tests/helm_chart.rs; no helm binary is needed).
command -v kubernetes-validate >/dev/null 2>&1 || python3 -m pip install -q kubernetes-validate
python3 -c "import helm_python" >/dev/null 2>&1 || python3 -m pip install -q "helm-python-sdk==0.2.2"
# The lock API against its OpenAPI description (tests/openapi.rs), and the
# Python client examples (tests/examples.rs).
command -v st >/dev/null 2>&1 || python3 -m pip install -q "schemathesis==4.32.5"
python3 -c "import requests" >/dev/null 2>&1 || python3 -m pip install -q requests
# --- issue 31: a true Dapr drop-in ---
# Dapr's official SDKs against fencer's Dapr APIs (tests/dapr_sdk.rs):
# the Node SDK pinned by tests/dapr_sdk/package-lock.json, Python's `dapr`.
if ! command -v npm >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends npm
fi
[ -f tests/dapr_sdk/node_modules/@dapr/dapr/package.json ] \
  || (cd tests/dapr_sdk && npm ci --no-audit --no-fund --loglevel=error)
python3 -c "import dapr.clients" >/dev/null 2>&1 || python3 -m pip install -q "dapr==1.19.0"
# --- end ---
# --- issue 31: client libraries (tests/clients.rs) ---
# pip builds clients/python from its folder offline (--no-build-isolation:
# the machine's setuptools and wheel); tsc checks clients/node's types.
python3 -c "import setuptools, wheel" >/dev/null 2>&1 || python3 -m pip install -q "setuptools>=61" wheel
[ -x "$HOME/.cache/fencer-tsc/node_modules/.bin/tsc" ] ||
  npm install --prefix "$HOME/.cache/fencer-tsc" --no-audit --no-fund --silent "typescript@5"
# --- end ---
echo "install (apt-get, pip) $(( $(date +%s) - install_start ))" >> "$FENCER_CI_DIR/phases"

build_phase="build (test profile)"
case "${RUSTC_WORKSPACE_WRAPPER:-}" in *clippy-driver*) build_phase="build (test profile) + clippy lints" ;; esac
timed "$build_phase" cargo test --all-targets --locked --no-run
# Every test binary cargo test would run (tests/run_binaries.py: two at a
# time, each timed; FENCER_TEST_JOBS=1 runs one at a time). Servers that a
# test only uses are shared per binary (tests/common/shared.rs;
# FENCER_TEST_SHARED=0 gives each test its own).
timed "tests (cargo test)" bash -c 'set -o pipefail; python3 tests/run_binaries.py 2>&1 | tee "$FENCER_CI_DIR/cargo-test.log"'

# The fault suite's PR tier (docs/faults.md): real processes under seeded
# faults, histories checked, every mutant must turn it red. It uses the
# debug binary the tests above built. Two runs at a time: a run keeps a
# quarter of a core busy (most of it waits on its schedule), so two fit on
# two cores with room for their bursts; every family still runs every time.
# The fault checker's own unit tests (tiny synthetic histories: each
# check fails on the history it must refuse).
timed "fault checker unit tests" python3 -m unittest discover -s tests/faults -p 'test_*.py'
timed "fault suite (PR tier)" bash -c 'set -o pipefail; python3 tests/faults/run.py --tier pr --jobs "${FENCER_FAULT_JOBS:-2}" 2>&1 | tee "$FENCER_CI_DIR/faults.log"'
