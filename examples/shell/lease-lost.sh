#!/usr/bin/env bash
# Notice a lost lease and stop writing. The lease has a short TTL and nobody
# renews it; a pause longer than the TTL (a GC pause, a stalled VM) lets it
# expire. The proxy then refuses the next write under it with 409 lease_lost
# instead of forwarding it, and the worker must stop: another worker may hold
# the lock now.
# Needs curl and jq.
set -euo pipefail
API=${FENCER_API:-http://127.0.0.1:7411}
PROXY=${FENCER_PROXY:-http://127.0.0.1:7412}
KEY=example:lost

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

lease=$(call POST "$API/v1/locks/$KEY/acquire" '{"ttl_ms":1000,"wait_ms":5000}') || fail "$lease"
echo "acquired token=$(jq -r .token <<<"$lease") ttl_ms=$(jq -r .ttl_ms <<<"$lease")"
fenced="Fencing-Lease: $(jq -r .lease_id <<<"$lease")"

for balance in 1 2 3; do
  if ! out=$(call PUT "$PROXY/kv/example/lost" "{\"balance\":$balance}" -H "$fenced"); then
    [ "$(jq -r .error <<<"$out")" = lease_lost ] || fail "$out"
    echo "lease lost: stopping"
    exit 0
  fi
  echo "write ok balance=$balance"
  echo "pausing 1500 ms (longer than the ttl, no renew)"
  sleep 1.5
done
fail "the lease should have been lost"
