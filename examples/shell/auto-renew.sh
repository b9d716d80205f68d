#!/usr/bin/env bash
# Auto-renew with keepalive: the sidecar renews the lease for us as long as
# we show we are alive (a keepalive call, or a proxied request under the
# lease, within keepalive_ms). If this script hangs or dies, renewal stops
# and the lease runs out within keepalive_ms + ttl_ms.
# Needs curl and jq.
set -euo pipefail
API=${FENCER_API:-http://127.0.0.1:7411}
KEY=example:auto-renew

# call METHOD URL [JSON [CURL ARGS...]]: prints the answer's body; fails unless 200.
call() {
  local out
  out=$(curl -sS -X "$1" "$2" -H 'Content-Type: application/json' ${3:+-d "$3"} "${@:4}" -w '\n%{http_code}') || return 2
  printf '%s\n' "${out%$'\n'*}"
  [ "${out##*$'\n'}" = 200 ]
}
# fail BODY: prints an error answer ({"error": code, "message": text}) and exits
# (with no answer, curl has already said why).
fail() {
  [ -z "$1" ] || jq -r '"error: \(.error): \(.message)"' <<<"$1" >&2 2>/dev/null || echo "error: $1" >&2
  exit 1
}

lease=$(call POST "$API/v1/locks/$KEY/acquire" \
  '{"ttl_ms":1000,"auto_renew":true,"keepalive_ms":2000,"wait_ms":5000}') || fail "$lease"
echo "acquired token=$(jq -r .token <<<"$lease") ttl_ms=$(jq -r .ttl_ms <<<"$lease")"
lease_id=$(jq -c '{lease_id}' <<<"$lease")
release() {
  local out
  out=$(call POST "$API/v1/locks/$KEY/release" "$lease_id") || fail "$out"
  echo released
}
trap release EXIT

for step in 1 2 3 4 5 6; do
  sleep 0.5 # one chunk of work
  # "I am alive"; 409 lease_lost here means: stop working, the lock is gone
  out=$(call POST "$API/v1/locks/$KEY/keepalive" "$lease_id") || fail "$out"
  echo "step $step: keepalive ok"
done
out=$(call GET "$API/v1/locks/$KEY") || fail "$out"
echo "after 3000 ms with a 1000 ms ttl: $(jq -r .state <<<"$out")"
