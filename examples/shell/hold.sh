#!/usr/bin/env bash
# Hold a lock for exactly as long as an HTTP connection: POST .../hold answers
# a stream of JSON lines (acquired, then a heartbeat every second, and a last
# line if the lease is lost). Closing the stream releases the lock at once,
# and so does this process dying.
# Needs curl and jq.
set -euo pipefail
API=${FENCER_API:-http://127.0.0.1:7411}
KEY=example:hold

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

# The stream on file descriptor 3; curl -N passes each line on as it arrives.
exec 3< <(curl -sSN -XPOST "$API/v1/locks/$KEY/hold" -H 'Content-Type: application/json' \
  -d '{"ttl_ms":5000,"wait_ms":5000}')
hold=$!
beats=0
while [ "$beats" -lt 2 ] && IFS= read -r event <&3; do
  case $(jq -r '.type // "error"' <<<"$event") in
    acquired) echo "acquired token=$(jq -r .token <<<"$event")" ;; # start acting as the leader
    heartbeat)
      echo "heartbeat remaining_ms=$(jq -r .remaining_ms <<<"$event")"
      beats=$((beats + 1)) ;;
    error) fail "$event" ;;
    *) fail "lease ended: $event" ;; # "lost" or "released": stop acting as the leader now
  esac
done
[ "$beats" -eq 2 ] || fail "the stream ended early"
kill "$hold" # done leading: curl exits, the connection closes, the sidecar releases the lock
exec 3<&-
echo "stream closed"

# The sidecar released the lock when the stream closed: it is free again.
lease=$(call POST "$API/v1/locks/$KEY/acquire" '{"wait_ms":2000}') || fail "$lease"
echo "lock free again token=$(jq -r .token <<<"$lease")"
out=$(call POST "$API/v1/locks/$KEY/release" "$(jq -c '{lease_id}' <<<"$lease")") || fail "$out"
