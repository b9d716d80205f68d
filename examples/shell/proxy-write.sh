#!/usr/bin/env bash
# Write to storage under a lock: send the request through the sidecar's
# egress proxy with `Fencing-Lease: <lease_id>`. The proxy adds the signed
# fencing token; the gateway in front of the storage refuses any write whose
# token is older than one it has already accepted for the key.
# Needs curl and jq.
set -euo pipefail
API=${FENCER_API:-http://127.0.0.1:7411}
PROXY=${FENCER_PROXY:-http://127.0.0.1:7412}
KEY=example:write

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

lease=$(call POST "$API/v1/locks/$KEY/acquire" '{"ttl_ms":10000,"wait_ms":5000}') || fail "$lease"
echo "acquired token=$(jq -r .token <<<"$lease")"
fenced="Fencing-Lease: $(jq -r .lease_id <<<"$lease")"
release() {
  local out
  out=$(call POST "$API/v1/locks/$KEY/release" "$(jq -c '{lease_id}' <<<"$lease")") || fail "$out"
  echo released
}
trap release EXIT

out=$(call PUT "$PROXY/kv/example/write" '{"balance":100}' -H "$fenced") || fail "$out"
echo "write ok"
out=$(call GET "$PROXY/kv/example/write" "" -H "$fenced") || fail "$out"
echo "read back balance=$(jq -r .value.balance <<<"$out")"
