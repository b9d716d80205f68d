"""A fault-suite worker: the hot-account read-modify-write workload.

Loop: acquire an account's lock through its sidecar → read the balance →
think → (maybe pause itself, right in the read→write window) → write
balance + 1 → release. In `proxy` mode reads and writes go through the
sidecar's egress proxy under the lease (`Fencing-Lease`); in `direct` mode
the worker carries the signed token to the gateway itself, numbering its
requests (`Fencing-Seq`). Every step is a history line (JSON, one per
line): invoke, then ok / fail (definitely not applied) / info (unknown:
a timeout or a 502/504 after the request may have been forwarded).

With the scenario's `clients` options (issue 28; all off by default):
`renew_p` renews the lease halfway through the think time (a 200 answer
is another "held" span; lease_lost or any other refusal ends the cycle
without the write) — in `elsewhere_p` of them through another sidecar of
the run, which adopts the lease id while its own sidecar lives on (the
release still goes to its own), `hold_p` takes the lock through `POST …/hold` instead
(an NDJSON stream: the grant, then heartbeats with the time left; closing
the stream is the release; such a cycle thinks `hold_think_ttl` × TTL),
and `disconnect_p` makes the client walk away from one step of the cycle
— acquire, renew, release or hold — after sending only the headers, half
the body, or all of it and 0–30 ms (see `abandon`); it then asks its
sidecar what it holds (`get`, probe).

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
import threading
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
        # Hold streams are read by a thread of their own (lines are
        # timestamped as they arrive): one writer at a time.
        self.hist_lock = threading.Lock()
        self.clients = cfg.get("clients") or {}

    def log(self, kind, f, **kv):
        with self.hist_lock:
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
        cfg, rng, cl = self.cfg, self.rng, self.clients
        key = rng.choice(cfg["keys"])
        lock = urllib.parse.quote(key, safe="")
        # The step of this cycle the client walks away from, if any; a hold
        # disconnect makes this a hold cycle, the others an acquire cycle.
        # (No draws when an option is off: a schedule without `clients`
        # runs the workload it always ran.)
        drop = None
        permits = cfg.get("semaphore_permits")
        if cl.get("disconnect_p") and rng.random() < cl["disconnect_p"] and not permits:
            drop = self.next_step()
        use_hold = not permits and (drop == "hold" or (drop is None and bool(cl.get("hold_p"))
                                                       and rng.random() < cl["hold_p"]))
        body = {"ttl_ms": cfg["ttl_ms"], "wait_ms": cfg["wait_ms"], "owner": self.wid}
        if drop in ("acquire", "hold"):
            self.abandon(drop, f"{cfg['api']}/v1/locks/{lock}/{drop}", body, lock, key=key)
            time.sleep(0.02)
            return
        hold = None
        if use_hold:
            hold = self.open_hold(lock, key, body)
            if hold is None:
                time.sleep(0.02)
                return
            lease = hold.grant
        elif permits:
            # A permit of semaphore `key`: from here on a lease on its slot
            # key, which the answer names (renew, release and writes use it).
            asked = permits
            if self.ops and rng.random() < cfg.get("semaphore_other_count_p", 0):
                # Another count than the name's, once it is fixed (this
                # worker wrote under a permit already): refused,
                # `permits_mismatch` (the `permits_unchecked` mutant lets
                # it count one slot more).
                asked = permits + 1
            acq = self.call("acquire", "POST", f"{cfg['api']}/v1/semaphores/{lock}/acquire",
                            body=dict(body, permits=asked), timeout=(cfg["wait_ms"] + 5000) / 1000,
                            key=key, semaphore=key, permits=asked)
            if not acq or acq[0] != 200:
                time.sleep(0.02)
                return
            lease = acq[1]
            key = lease["key"]
            lock = urllib.parse.quote(key, safe="")
        else:
            # Read-write locks (issue 33 item 2): a read lease in `read_p`
            # of the cycles. Its cycle is a writer's — read, think, write —
            # and its write must be refused (`read_lease`): by the proxy,
            # or, carrying its token itself, by the gateway.
            read = drop is None and rng.random() < cfg.get("read_p", 0)
            acq = self.call("acquire", "POST", f"{cfg['api']}/v1/locks/{lock}/acquire",
                            body=dict(body, mode="read") if read else body,
                            timeout=(cfg["wait_ms"] + 5000) / 1000, key=key, **({"read": True} if read else {}))
            if not acq or acq[0] != 200:
                time.sleep(0.02)
                return
            lease = acq[1]
        token, lease_id, wire = lease["token"], lease["lease_id"], lease["fencing_token"]
        ctx = {"key": key, "token": token, "lease": lease_id, "tag": lease_tag(lease_id)}
        if lease.get("mode") == "read":
            ctx["read"] = True
        if hold:
            hold.start(ctx)
        self.seq = 0
        storage_path = f"/kv/{urllib.parse.quote(key, safe='')}"

        def end():
            if hold:
                self.close_hold(hold, ctx)
            else:
                self.release(lock, lease_id, ctx, abandon=drop == "release")

        def headers():
            if cfg["mode"] == "proxy":
                return {"Fencing-Lease": lease_id}, cfg["proxy"]
            self.seq += 1
            return {"Fencing-Token": wire, "Fencing-Key": key, "Fencing-Seq": str(self.seq)}, cfg["gateway"]

        h, base = headers()
        r = self.call("read", "GET", base + storage_path, h, seq=self.seq, **ctx)
        if not r or r[0] not in (200, 404):
            # A hold dies with its sidecar; a lease of a killed sidecar is
            # adopted by its restart (sidecar-clock-restart).
            if not hold and self.sidecar_gone(r) and self.adopt(lock, lease_id, ctx):
                self.write_adopted(storage_path, ctx)
            end()
            return
        balance = r[1].get("balance", 0) if r[0] == 200 else 0
        think = rng.uniform(*cfg["think_ms"])
        if hold and cl.get("hold_think_ttl"):
            # Holds that last long enough to be renewed by the sidecar and
            # to carry heartbeats.
            think = rng.uniform(*cl["hold_think_ttl"]) * cfg["ttl_ms"]
        if not hold and (drop == "renew" or (cl.get("renew_p") and rng.random() < cl["renew_p"])):
            # Halfway through the think time: a client making sure of its
            # lease before it writes. Through another sidecar, it thinks
            # past the TTL its own sidecar granted (the renewal carries it):
            # whatever its own sidecar does at that deadline must leave the
            # renewed lease alone.
            elsewhere = None if drop == "renew" else self.elsewhere()
            if elsewhere:
                think = max(think, rng.uniform(*cl.get("elsewhere_think_ttl", [1.2, 1.8])) * cfg["ttl_ms"])
            time.sleep(think / 2000)
            if not self.renew(lock, lease_id, ctx, abandon=drop == "renew", api=elsewhere):
                end()
                return
            time.sleep(think / 2000)
        else:
            time.sleep(think / 1000)
        if hold and hold.over():
            # The sidecar said the lease is lost (or the stream ended):
            # a client that listens does not write.
            end()
            return
        # Hold cycles do not stop themselves: a frozen client's hold stays
        # open and renewed (its sidecar cannot tell), and heartbeat lines
        # buffered during the freeze would be read (timestamped) after it.
        if not hold and rng.random() < cfg.get("self_pause_p", 0):
            lo, hi = cfg["self_pause_ttl"]
            self.pause_self(int(rng.uniform(lo, hi) * cfg["ttl_ms"]))
        self.ops += 1
        op_id = f"{self.wid}-{self.ops}"
        h, base = headers()
        body = {"balance": balance + 1, "op_id": op_id, "prev": balance}
        w = self.call("write", "PUT", base + storage_path, h, body, seq=self.seq, op_id=op_id,
                      prev=balance, new=balance + 1, **ctx)
        if not hold and self.sidecar_gone(w) and self.adopt(lock, lease_id, ctx):
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
        end()

    def next_step(self):
        """The step to walk away from next: drawn from a shuffled deck of
        `disconnect_steps`, refilled when empty, so that a run with few
        walk-aways still covers every step (each is a bite)."""
        if not getattr(self, "deck", None):
            self.deck = list(self.clients.get("disconnect_steps", DISCONNECT_STEPS))
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    def elsewhere(self):
        """Another sidecar's lock API to renew through, in `elsewhere_p` of
        the renewals (a client that moved, or one with two sidecars: that
        one adopts the lease id while this one lives on); else None."""
        p, others = self.clients.get("elsewhere_p", 0), self.cfg.get("other_apis") or []
        if p and others and self.rng.random() < p:
            return self.rng.choice(others)
        return None

    def renew(self, lock, lease_id, ctx, abandon=False, api=None):
        """Renews the lease; True if the client may go on (a 200 answer —
        its time left is a "held" span for M1 — or, after walking away
        from the renewal, a probe that still says "held" for this lease).
        lease_lost, an expired lease or any other refusal: False, and the
        cycle ends without its write."""
        via = {"elsewhere": True} if api else {}
        url = f"{api or self.cfg['api']}/v1/locks/{lock}/renew"
        body = {"lease_id": lease_id, "ttl_ms": self.cfg["ttl_ms"]}
        if abandon:
            p = self.abandon("renew", url, body, lock, **ctx)
            return bool(p and p[0] == 200 and p[1].get("state") == "held" and p[1].get("lease_tag") == ctx["tag"])
        r = self.call("renew", "POST", url, body=body, **via, **ctx)
        return bool(r and r[0] == 200)

    def abandon(self, step, url, body, lock, **ctx):
        """A client that walks away from `step` (issue 28): it opens the
        request and closes its socket after sending only the headers, half
        the body, or all of it and then 0–30 ms (`disconnect_ms`), without
        reading an answer. Logged as `info` with the step (`disconnect`),
        how (`how`) and whether an answer had arrived by then (`answered`,
        its status, peeked, not read). Then, after `probe_delay_ms` (the
        sidecar has seen the close by then; docs/faults.md, the probe's
        blind spot), the client asks its sidecar what it holds: the
        probe's answer is returned."""
        cl, rng = self.clients, self.rng
        how = rng.choice(cl.get("disconnect_how", DISCONNECT_HOW))
        delay = 0.0 if how == "at_once" else rng.uniform(*cl.get("disconnect_ms", [0, 30]))
        self.log("invoke", step, disconnect=step, how=how, delay_ms=round(delay, 1), ttl_ms=body.get("ttl_ms"),
                 **ctx)
        try:
            answered = walk_away(url, body, how, delay / 1000, self.http.timeout)
            self.log("info", step, error="disconnect", disconnect=step, how=how, answered=answered, **ctx)
        except OSError as e:
            self.log("info", step, error="connect", disconnect=step, how=how, detail=str(e)[:80], **ctx)
        time.sleep(cl.get("probe_delay_ms", 100) / 1000)
        return self.call("get", "GET", f"{self.cfg['api']}/v1/locks/{lock}", key=ctx["key"], probe=True,
                         after=step)

    def open_hold(self, lock, key, body):
        """`POST …/hold`; the stream once its first line granted the lease
        (logged as an `ok` hold line, the lease in `resp`), else None."""
        cfg = self.cfg
        self.log("invoke", "hold", key=key)
        hs = HoldStream(self, f"{cfg['api']}/v1/locks/{lock}/hold", body, (cfg["wait_ms"] + 5000) / 1000)
        try:
            status, first = hs.open()
        except (OSError, http.client.HTTPException, ValueError):
            hs.abort()
            self.log("info", "hold", error="timeout", key=key)
            return None
        code = first.get("error") if isinstance(first, dict) else None
        if status == 200 and first.get("type") == "acquired":
            self.log("ok", "hold", status=status, resp=first, key=key)
            hs.grant = first
            return hs
        hs.abort()
        if status == 200:
            self.log("fail", "hold", status=status, error=first.get("type"), resp=first, key=key)
        elif status in UNKNOWN:
            self.log("info", "hold", status=status, error=code, key=key)
        else:
            self.log("fail", "hold", status=status, error=code, key=key)
        return None

    def close_hold(self, hold, ctx):
        """Ends a hold by closing its stream (the hold's release). The
        client's hold ends at the close (`hold_close` invoke); no line read
        after it is logged."""
        with hold.lock:
            hold.closing = True
            self.log("invoke", "hold_close", **ctx)
        hold.abort()
        self.log("ok", "hold_close", **ctx)

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

    def release(self, lock, lease_id, ctx, abandon=False):
        """Releases the lease. With `short_release_p`, the client gives up
        after `short_release_ms` (a client that disconnects mid-release:
        PITFALLS 12). Its outcome is then unknown to it (`info`); its hold
        ended when it sent the release, and it asks its sidecar what it
        holds now (`get`): an answer "held" for the lease it gave back,
        while the backend may have handed the key on, is a second holder
        (M1 checks it). `abandon`: the client walks away from the release
        (`abandon`), then asks the same."""
        cfg = self.cfg
        url = f"{cfg['api']}/v1/locks/{lock}/release"
        if abandon:
            self.abandon("release", url, {"lease_id": lease_id}, lock, **ctx)
            return
        short = self.rng.random() < cfg.get("short_release_p", 0)
        timeout = cfg.get("short_release_ms", 200) / 1000 if short else None
        extra = {"short_ms": cfg.get("short_release_ms", 200)} if short else {}
        r = self.call("release", "POST", url, body={"lease_id": lease_id}, timeout=timeout, **extra, **ctx)
        if short and r is None:
            self.call("get", "GET", f"{cfg['api']}/v1/locks/{lock}", key=ctx["key"], probe=True)


# The steps a client may walk away from, and how (`abandon`).
DISCONNECT_STEPS = ("acquire", "renew", "release", "hold")
DISCONNECT_HOW = ("headers", "half_body", "at_once", "delay")


def walk_away(url, body, how, delay_s, timeout):
    """Sends `POST url` with a JSON `body` on a connection of its own —
    only the headers (`headers`), the headers and half the body
    (`half_body`), or all of it (`at_once`, `delay`) — waits `delay_s`
    and closes the socket without reading. Returns the status of an
    answer that had arrived by then (peeked), or None."""
    u = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    s = socket.create_connection((u.hostname, u.port), timeout=timeout)
    try:
        if how == "headers":
            s.sendall(head)
        elif how == "half_body":
            s.sendall(head + data[:len(data) // 2])
        else:
            s.sendall(head + data)
        if delay_s > 0:
            time.sleep(delay_s)
        # A socket with a timeout waits for data before a recv, whatever
        # the flags: look without waiting.
        s.setblocking(False)
        try:
            peek = s.recv(16, socket.MSG_PEEK)
        except OSError:
            peek = b""
        return int(peek[9:12]) if peek.startswith(b"HTTP/1.1 ") and peek[9:12].isdigit() else None
    finally:
        s.close()


class HoldStream:
    """One `POST …/hold` on a connection of its own. `open` reads the
    first line (the grant); then a thread logs every later line as it
    arrives (`hold_line`: heartbeats with the time left, or the end), and
    `over` says whether the stream said the lease is gone."""

    def __init__(self, worker, url, body, timeout):
        self.w, self.url, self.body, self.timeout = worker, url, body, timeout
        self.conn = self.resp = self.grant = self.thread = None
        self.lock = threading.Lock()
        self.closing = False
        self.ended = None  # the line (or "eof") that ended the stream

    def open(self):
        u = urllib.parse.urlsplit(self.url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout)
        self.conn.request("POST", u.path, body=json.dumps(self.body).encode(),
                          headers={"content-type": "application/json"})
        self.resp = self.conn.getresponse()
        if self.resp.status != 200:
            raw = self.resp.read()
            try:
                return self.resp.status, json.loads(raw) if raw else {}
            except ValueError:
                return self.resp.status, {"raw": raw.decode(errors="replace")}
        line = self.resp.readline()
        return 200, json.loads(line)

    def start(self, ctx):
        self.ctx = ctx
        if self.conn.sock is not None:
            self.conn.sock.settimeout(None)  # heartbeats come as they come
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while True:
            try:
                line = self.resp.readline()
            except (OSError, ValueError, http.client.HTTPException):
                line = b""
            with self.lock:
                if self.closing:
                    return
                if not line:
                    self.ended = "eof"
                    self.w.log("ok", "hold_line", resp={"type": "eof"}, **self.ctx)
                    return
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if obj.get("type") != "heartbeat":
                    self.ended = obj.get("type")
                self.w.log("ok", "hold_line", resp=obj, **self.ctx)
                if self.ended:
                    return

    def over(self):
        return self.ended is not None

    def abort(self):
        """Closes the connection (FIN): the sidecar releases the lease."""
        sock = self.conn.sock if self.conn else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.thread is not None:
            self.thread.join(2)
        if self.conn is not None:
            self.conn.close()


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    Worker(cfg).run()


if __name__ == "__main__":
    main()
