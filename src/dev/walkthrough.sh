# Worker A takes the lock for 3 s. The answer carries its lease and its fencing token.
A=$(curl -s -XPOST localhost:7411/v1/locks/account:1/acquire -d '{"ttl_ms":3000}'); echo "$A"
# A writes through the egress proxy, naming its lease; the proxy adds the signed token.
curl -s -XPUT localhost:7412/kv/accounts/1 -H "Fencing-Lease: $(echo "$A" | jq -r .lease_id)" -d '{"balance":100}'; echo
# A stalls (a GC pause, a frozen VM) past its 3 s. Worker B takes the lock, with a higher token, and writes.
sleep 4
B=$(curl -s -XPOST localhost:7411/v1/locks/account:1/acquire -d '{"ttl_ms":30000}'); echo "$B"
curl -s -XPUT localhost:7412/kv/accounts/1 -H "Fencing-Lease: $(echo "$B" | jq -r .lease_id)" -d '{"balance":200}'; echo
# A wakes up and writes. Its sidecar knows the lease is gone: refused, 409 lease_lost.
curl -s -XPUT localhost:7412/kv/accounts/1 -H "Fencing-Lease: $(echo "$A" | jq -r .lease_id)" -d '{"balance":101}'; echo
# Even its signed token sent straight to the gateway is refused: 409 stale_fencing_token.
curl -s -XPUT localhost:8080/kv/accounts/1 -H "Fencing-Token: $(echo "$A" | jq -r .fencing_token)" -d '{"balance":101}'; echo
# The storage kept B's write.
curl -s localhost:8081/kv/accounts/1; echo
