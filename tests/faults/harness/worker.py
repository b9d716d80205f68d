"""A fault-suite worker: the hot-account read-modify-write workload.

Loop: acquire an account's lock through its sidecar → read the balance →
think → (maybe pause itself, right in the read→write window) → write
balance + 1 → release. In `proxy` mode reads and writes go through the
sidecar's egress proxy under the lease (`Fencing-Lease`); in `direct` mode
the worker carries the signed token to the gateway itself, numbering its
requests (`Fencing-Seq`). Every step is a history line (JSON, one per
line): invoke, then ok / fail (definitely not applied) / info (unknown:
a timeout or a 502/504 after the request may have been forwarded).

Run as: python3 -m harness.worker CONFIG.json
"""
import base64
import hashlib
import http.client
import json
import os
import random
import signal
import socket
import sys
import time
import urllib.parse


def lease_tag(lease_id):
    d = hashlib.sha256(b"fencer-lease-tag:" + lease_id.encode()).digest()[:12]
    return base64.urlsafe_b64encode(d).decode().rstrip("=")


class Http:
    """One keep-alive connection per base URL; a failure closes it."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.conns = {}

    def request(self, method, url, headers=None, body=None, timeout=None):
        u = urllib.parse.urlsplit(url)
        key = u.netloc
        conn = self.conns.get(key)
        if conn is None:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout or self.timeout)
            self.conns[key] = conn
        conn.timeout = timeout or self.timeout
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
        path = u.path + (("?" + u.query) if u.query else "")
        data = json.dumps(body).encode() if body is not None else None
        hdrs = dict(headers or {})
        if data is not None:
            hdrs["content-type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            raw = r.read()
        except (OSError, http.client.HTTPException, socket.timeout):
            conn.close()
            self.conns.pop(key, None)
            raise
        try:
            parsed = json.loads(raw) if raw else {}
        except ValueError:
            parsed = {"raw": raw.decode(errors="replace")}
        return r.status, parsed


# Answers after which the request may have reached the storage.
UNKNOWN = {502, 504}


class Worker:
    def __init__(self, cfg):
        self.cfg = cfg
        self.wid = cfg["id"]
        self.rng = random.Random(cfg["seed"])
        self.http = Http(cfg.get("timeout_ms", 3000) / 1000)
        self.hist = open(cfg["history"], "a", buffering=1)
        self.ops = 0

    def log(self, kind, f, **kv):
        kv.update(t=time.monotonic_ns(), proc=self.wid, kind=kind, f=f)
        self.hist.write(json.dumps(kv) + "\n")

    def call(self, f, method, url, headers=None, body=None, timeout=None, **kv):
        """One request as an invoke + outcome pair; returns (status, body) or None."""
        self.log("invoke", f, **kv)
        try:
            status, resp = self.http.request(method, url, headers, body, timeout)
        except (OSError, http.client.HTTPException):
            self.log("info", f, error="timeout", **kv)
            return None
        code = resp.get("error") if isinstance(resp, dict) else None
        if status < 300 or (f == "read" and status == 404):
            self.log("ok", f, status=status, resp=resp, **kv)
        elif status in UNKNOWN:
            self.log("info", f, status=status, error=code, **kv)
        else:
            self.log("fail", f, status=status, error=code, **kv)
        return status, resp

    def pause_self(self, d_ms):
        """Stops this process; the harness continues it after `d_ms`."""
        req = self.cfg["pause_file"]
        with open(req + ".tmp", "w") as f:
            f.write(str(d_ms))
        os.rename(req + ".tmp", req)
        self.log("ok", "pause", d_ms=d_ms)
        os.kill(os.getpid(), signal.SIGSTOP)
        self.log("ok", "resumed")

    def run(self):
        cfg = self.cfg
        end = time.monotonic() + cfg["duration_s"]
        while time.monotonic() < end:
            self.cycle()
        self.log("ok", "done")

    def cycle(self):
        cfg, rng = self.cfg, self.rng
        key = rng.choice(cfg["keys"])
        lock = urllib.parse.quote(key, safe="")
        acq = self.call("acquire", "POST", f"{cfg['api']}/v1/locks/{lock}/acquire",
                        body={"ttl_ms": cfg["ttl_ms"], "wait_ms": cfg["wait_ms"], "owner": self.wid},
                        timeout=(cfg["wait_ms"] + 5000) / 1000, key=key)
        if not acq or acq[0] != 200:
            time.sleep(0.02)
            return
        lease = acq[1]
        token, lease_id, wire = lease["token"], lease["lease_id"], lease["fencing_token"]
        ctx = {"key": key, "token": token, "lease": lease_id, "tag": lease_tag(lease_id)}
        self.seq = 0
        storage_path = f"/kv/{urllib.parse.quote(key, safe='')}"

        def headers():
            if cfg["mode"] == "proxy":
                return {"Fencing-Lease": lease_id}, cfg["proxy"]
            self.seq += 1
            return {"Fencing-Token": wire, "Fencing-Key": key, "Fencing-Seq": str(self.seq)}, cfg["gateway"]

        h, base = headers()
        r = self.call("read", "GET", base + storage_path, h, seq=self.seq, **ctx)
        if not r or r[0] not in (200, 404):
            if self.sidecar_gone(r) and self.adopt(lock, lease_id, ctx):
                self.write_adopted(storage_path, ctx)
            self.release(lock, lease_id, ctx)
            return
        balance = r[1].get("balance", 0) if r[0] == 200 else 0
        think = rng.uniform(*cfg["think_ms"])
        time.sleep(think / 1000)
        if rng.random() < cfg.get("self_pause_p", 0):
            lo, hi = cfg["self_pause_ttl"]
            self.pause_self(int(rng.uniform(lo, hi) * cfg["ttl_ms"]))
        self.ops += 1
        op_id = f"{self.wid}-{self.ops}"
        h, base = headers()
        body = {"balance": balance + 1, "op_id": op_id, "prev": balance}
        w = self.call("write", "PUT", base + storage_path, h, body, seq=self.seq, op_id=op_id,
                      prev=balance, new=balance + 1, **ctx)
        if self.sidecar_gone(w) and self.adopt(lock, lease_id, ctx):
            self.write_adopted(storage_path, ctx)
        if (w and w[0] == 200 and cfg["mode"] == "direct"
                and rng.random() < cfg.get("replay_p", 0)):
            # A delayed duplicate of this lease's earlier read request: the
            # gateway must refuse it (its sequence is below the last).
            old = {"Fencing-Token": wire, "Fencing-Key": key, "Fencing-Seq": str(self.seq - 1)}
            self.ops += 1
            body2 = {"balance": balance, "op_id": f"{self.wid}-{self.ops}", "prev": balance - 1}
            self.call("write", "PUT", base + storage_path, old, body2, seq=self.seq - 1,
                      op_id=body2["op_id"], prev=balance - 1, new=balance, replay=True, **ctx)
        if rng.random() < cfg.get("forge_p", 0):
            self.forge(base, storage_path, wire, key)
        self.release(lock, lease_id, ctx)

    # ------------------------------------------------------------ adoption
    # With `adopt_after_restart` (proxy mode), a worker whose sidecar went
    # away under its lease (a write refused at the connection, or 428
    # lock_not_held from a sidecar restarted without its memory) renews
    # the lease until the restarted sidecar adopts it, then reads and
    # writes once more under it: the adopted lease's writes must go on
    # with increasing Fencing-Seq whatever the sidecar's clock did across
    # the restart (issue 27 item 7, issue 28; harness/clock_restarts.py).

    def sidecar_gone(self, r):
        return (self.cfg.get("adopt_after_restart") and self.cfg["mode"] == "proxy"
                and (r is None or (r[0] == 428 and (r[1] or {}).get("error") == "lock_not_held")))

    def adopt(self, lock, lease_id, ctx):
        """Renews the lease (1 s per try) until a sidecar answers it:
        True once adopted (200), False when it is lost (409) or after
        `adopt_within_ms`."""
        cfg = self.cfg
        end = time.monotonic() + cfg.get("adopt_within_ms", 6000) / 1000
        while time.monotonic() < end:
            r = self.call("renew", "POST", f"{cfg['api']}/v1/locks/{lock}/renew",
                          body={"lease_id": lease_id, "ttl_ms": cfg["ttl_ms"]}, timeout=1.0, adopting=True, **ctx)
            if r and r[0] == 200:
                return True
            if r and r[0] == 409:
                return False
            time.sleep(0.1)
        return False

    def write_adopted(self, storage_path, ctx):
        """One read-modify-write under an adopted lease (its lines say
        `adopted`)."""
        cfg, h = self.cfg, {"Fencing-Lease": ctx["lease"]}
        ctx = dict(ctx, adopted=True)
        r = self.call("read", "GET", cfg["proxy"] + storage_path, h, **ctx)
        if not r or r[0] not in (200, 404):
            return
        balance = r[1].get("balance", 0) if r[0] == 200 else 0
        self.ops += 1
        op_id = f"{self.wid}-{self.ops}"
        body = {"balance": balance + 1, "op_id": op_id, "prev": balance}
        self.call("write", "PUT", cfg["proxy"] + storage_path, h, body, op_id=op_id, prev=balance,
                  new=balance + 1, **ctx)

    def forge(self, base, path, wire, key):
        """A write with an inflated token: refused unless the gateway stopped
        checking signatures."""
        parts = wire.split(".")
        parts[2] = str(int(parts[2]) + (1 << 40))
        self.ops += 1
        op_id = f"{self.wid}-{self.ops}"
        self.call("write", "PUT", self.cfg["gateway"] + path,
                  {"Fencing-Token": ".".join(parts), "Fencing-Key": key},
                  {"balance": 0, "op_id": op_id, "prev": -1}, key=key, op_id=op_id, forged=True)

    def release(self, lock, lease_id, ctx):
        """Releases the lease. With `short_release_p`, the client gives up
        after `short_release_ms` (a client that disconnects mid-release:
        PITFALLS 12). Its outcome is then unknown to it (`info`); its hold
        ended when it sent the release, and it asks its sidecar what it
        holds now (`get`): an answer "held" for the lease it gave back,
        while the backend may have handed the key on, is a second holder
        (M1 checks it)."""
        cfg = self.cfg
        short = self.rng.random() < cfg.get("short_release_p", 0)
        timeout = cfg.get("short_release_ms", 200) / 1000 if short else None
        extra = {"short_ms": cfg.get("short_release_ms", 200)} if short else {}
        r = self.call("release", "POST", f"{cfg['api']}/v1/locks/{lock}/release",
                      body={"lease_id": lease_id}, timeout=timeout, **extra, **ctx)
        if short and r is None:
            self.call("get", "GET", f"{cfg['api']}/v1/locks/{lock}", key=ctx["key"], probe=True)


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    Worker(cfg).run()


if __name__ == "__main__":
    main()
