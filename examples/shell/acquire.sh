#!/usr/bin/env bash
# Acquire a lock, waiting for it if another worker holds it; print the
# fencing token; release it. A second acquire while we hold the lock shows
# how an error answer ({"error": code, "message": text}) looks.
# Needs curl and jq.
set -euo pipefail
API=${FENCER_API:-http://127.0.0.1:7411}
KEY=example:acquire

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

# Wait up to 5 s in the key's FIFO queue if someone else holds it.
lease=$(call POST "$API/v1/locks/$KEY/acquire" '{"ttl_ms":10000,"wait_ms":5000}') || fail "$lease"
echo "acquired token=$(jq -r .token <<<"$lease")"
release() {
  local out
  out=$(call POST "$API/v1/locks/$KEY/release" "$(jq -c '{lease_id}' <<<"$lease")") || fail "$out"
  echo released
}
trap release EXIT

# ... do the work the lock protects ...
# another worker would wait 200 ms, then get 409 lock_held
if ! other=$(call POST "$API/v1/locks/$KEY/acquire" '{"wait_ms":200}'); then
  echo "second acquire refused: $(jq -r .error <<<"$other")"
fi
