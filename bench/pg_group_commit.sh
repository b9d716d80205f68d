#!/bin/bash
# The PostgreSQL lock backend's group commit against one statement per call,
# on a PostgreSQL you give (fsync on, as in production; the `lock-backends`
# scenario of `fencer bench` starts its own with fsync off): two sidecars
# on the same database, `backend.postgres.group_commit` true and false,
# lost-update counters in a private Redis; uncontended-16 and contended-16
# through each, alternating, three runs. docs/performance.md shows a run.
#
#   bench/pg_group_commit.sh target/profiling/fencer postgres://postgres@127.0.0.1:55432/postgres
set -euo pipefail
BIN=${1:?usage: $0 FENCER_BINARY POSTGRES_URL}
PG=${2:?usage: $0 FENCER_BINARY POSTGRES_URL}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
DIR=$(mktemp -d)
RP=$(free_port)
redis-server --port "$RP" --bind 127.0.0.1 --save "" --appendonly no --dir "$DIR" >/dev/null &
REDIS=$!
pids=("$REDIS")
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$DIR"' EXIT
sidecar() { # name, api port, extra env...
  env FENCER_BENCH_SECRET=pg-group-commit-bench-secret-0123456789 \
    FENCER__SIGNING__SECRET_ENV=FENCER_BENCH_SECRET FENCER__LOG__LEVEL=warn \
    FENCER__PROXY__ENABLED=false FENCER__BACKEND__KIND=postgres \
    FENCER__BACKEND__POSTGRES__URL="$PG" \
    FENCER__SIDECAR__LISTEN=127.0.0.1:"$2" FENCER__ADMIN__LISTEN=127.0.0.1:"$(free_port)" \
    "${@:3}" "$BIN" sidecar >"$DIR/$1.log" 2>&1 &
  pids+=("$!")
}
ON=$(free_port)
OFF=$(free_port)
sidecar on "$ON"
sidecar off "$OFF" FENCER__BACKEND__POSTGRES__GROUP_COMMIT=false
sleep 3
for run in 1 2 3; do
  for side in on off; do
    port=$ON; [ "$side" = off ] && port=$OFF
    echo "== run $run, group commit $side"
    "$BIN" bench --api "http://127.0.0.1:$port" --redis "redis://127.0.0.1:$RP/0" \
      --scenario uncontended-16,contended-16 --no-baseline --seconds 5 | grep -E "^[a-z]|fencer "
  done
done
