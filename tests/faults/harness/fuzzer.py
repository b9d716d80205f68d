"""The request fuzzer (issue 28): while a run's faults go on, random
requests at the gateways — directly, and through the sidecars' egress
proxies — that a storage would take as writes.

Every request is a write with an op id of its own (`fz-<n>`, body
`"fuzz": true`): if the storage applies it, the commit log says so (the
storage records the key as *it* reads the path, and the raw token as it
received it). The checker's F1 then demands that every applied fuzz write
carried a token a sidecar issued for exactly that key, above the key's
previous applied (token, seq). An unknown outcome (timeout, 502/504) is
fine; an applied unfenced one fails the run.

The dimensions, mixed at random per request (`RECIPES`):

- methods: standard, lower/mixed case (`put`), extension methods (MOVE,
  PROPPATCH, PURGE, BREW...), a very long one, invalid tokens;
- paths for the scenario's keys: percent-encoded (single and double),
  `;params`, `//`, `/./`, `..`, trailing `/`, `.json`, full-width digits,
  Cyrillic look-alikes, case changes, query strings;
- body framing: Content-Length, chunked, Content-Length too short or too
  long, both at once, gzip content-encoding;
- `Fencing-*` headers: missing, duplicated (two lines, differently
  cased), comma-joined, folded (obs-fold);
- tokens from a real worker's recent answer (read from the histories as
  they are written): the current one, an older one replayed, inflated,
  attached to another key; and tokens the fuzzer acquired itself for
  look-alike keys (`acct-0;x`, `acct-0.json`, `acct-０`), sent to the
  look-alike's path and to the real key's.

Requests go out on raw sockets (`Connection: close`) so that anything can
be sent; nothing here goes through http.client's validation.
"""
import base64
import gzip
import json
import os
import random
import socket
import threading
import time
import urllib.parse

TIMEOUT_S = 2.5
# Answers after which the request may have reached the storage.
UNKNOWN = {502, 504}

METHODS_EXT = ["MOVE", "COPY", "MKCOL", "PROPPATCH", "MERGE", "PURGE", "BREW", "LOCK", "UNLOCK", "REPORT",
               "SEARCH", "LINK", "put", "Put", "pUT", "post", "delete", "patch", "Delete", "OPTIONS", "TRACE"]
METHODS_BAD = ["PU(T", "PU T", "P\x7fUT", "PUT\x00", "PÜT", "X" * 300, "M" * 5000, ""]
FULLWIDTH = {str(d): chr(0xFF10 + d) for d in range(10)}
CYRILLIC = {"a": "\u0430", "c": "\u0441"}


def q(s):
    return urllib.parse.quote(s, safe="")


def path_variants(key):
    """(label, path) forms a lenient storage reads as `key`'s object (or as
    another object) — all but `plain`/`unreserved`/`query` must be refused
    for a fenced request at a gateway with routes."""
    k = q(key)
    head, _, last = key.rpartition("-")
    full = "".join(FULLWIDTH.get(ch, ch) for ch in key)
    cyr = "".join(CYRILLIC.get(ch, ch) for ch in key)
    return [
        ("plain", f"/kv/{k}"),
        ("unreserved", "/kv/" + "".join(f"%{ord(ch):02X}" if ch.isalnum() and i % 2 == 0 else ch
                                        for i, ch in enumerate(key))),
        ("double_encoded", "/kv/" + key.replace("-", "%252D")),
        ("encoded_semicolon", f"/kv/{k}%3Bx"),
        ("params", f"/kv/{k};jsessionid=1"),
        ("params_mid", f"/kv;x/{k}"),
        ("double_slash", f"/kv//{k}"),
        ("dot", f"/kv/./{k}"),
        ("dotdot", f"/kv/other/../{k}"),
        ("encoded_dotdot", f"/kv/other/%2E%2E/{k}"),
        ("trailing_slash", f"/kv/{k}/"),
        ("json", f"/kv/{k}.json"),
        ("fullwidth", f"/kv/{q(full)}"),
        ("cyrillic", f"/kv/{q(cyr)}"),
        ("upper", f"/kv/{q(key.upper())}"),
        ("upper_prefix", f"/KV/{k}"),
        ("query", f"/kv/{k}?x=1&key={q(key)}"),
        ("encoded_slash", f"/kv/{q(head)}%2F..%2F{q(key)}" if head else f"/kv/%2F{k}"),
        ("backslash", f"/kv/x\\..\\{k}"),
        ("absolute_form", f"http://storage/kv/{k}"),
        ("absolute_form_params", f"http://storage/kv/{k};x"),
    ]


def lookalikes(key):
    """Lock keys that name another object to the gateway's routes but, to a
    lenient storage, maybe `key`'s (issue 26 item 8)."""
    full = "".join(FULLWIDTH.get(ch, ch) for ch in key)
    return [f"{key};x", f"{key}.json", full, key.upper(), f"{key}/", f"{key}%2D"]


def inflate(wire, by):
    parts = wire.split(".")
    if len(parts) == 6 and parts[2].isdigit():
        parts[2] = str(int(parts[2]) + by)
    return ".".join(parts)


def retarget(wire, key):
    """The token with its key claim changed (signature kept): forged."""
    parts = wire.split(".")
    if len(parts) == 6:
        parts[4] = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    return ".".join(parts)


def raw_request(port, data, timeout=TIMEOUT_S):
    """Sends `data` on a fresh connection; returns (status, body dict) or
    (None, reason) when no answer came."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError as e:
        return None, f"connect: {e.__class__.__name__}"
    try:
        s.settimeout(timeout)
        s.sendall(data)
        buf = b""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in buf:
            if time.monotonic() > deadline:
                return None, "timeout"
            chunk = s.recv(65536)
            if not chunk:
                return None, "closed" if not buf else "truncated head"
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ")[1])
        except (IndexError, ValueError):
            return None, "bad status line"
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    pass
        while length is not None and len(body) < length and time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        try:
            parsed = json.loads(body[:length] if length is not None else body) if body else {}
        except ValueError:
            parsed = {}
        return status, parsed if isinstance(parsed, dict) else {}
    except OSError as e:
        return None, f"io: {e.__class__.__name__}"
    finally:
        try:
            s.close()
        except OSError:
            pass


class Fuzzer:
    """A thread that fuzzes the gateways of `cluster` until stopped. Its
    history (`events`, also `fuzz.jsonl` in the run directory) has one
    invoke and one outcome line per request (`f`: "fuzz"), and the
    fuzzer's own acquires of look-alike keys (`f`: "acquire", with the
    answer: tokens F1 counts as issued)."""

    def __init__(self, cluster, seed, opts=None):
        self.cluster = cluster
        self.opts = dict(opts or {})
        self.rng = random.Random(seed * 7919 + 28)
        self.keys = list(cluster.sc["keys"])
        self.events = []
        self.hist = open(os.path.join(cluster.run_dir, "fuzz.jsonl"), "a", buffering=1)
        self.stop_flag = threading.Event()
        self.thread = None
        self.n = 0
        self.offsets = {}
        self.partial = {}
        self.answers = {k: [] for k in self.keys}  # key -> [(t, worker, resp)] newest last
        self.own = []  # the fuzzer's own look-alike leases: (sidecar index, key, resp)

    # ------------------------------------------------------------ history
    def log(self, kind, f, **kv):
        kv.update(t=time.monotonic_ns(), proc="fuzz", kind=kind, f=f)
        self.events.append(kv)
        self.hist.write(json.dumps(kv) + "\n")

    def poll_histories(self):
        """Reads the workers' new history lines: their acquire answers are
        the tokens to replay."""
        for i, w in enumerate(self.cluster.workers):
            path = w.cfg["history"]
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read()
                    self.offsets[path] = f.tell()
            except OSError:
                continue
            data = self.partial.pop(path, b"") + data
            lines = data.split(b"\n")
            if lines and lines[-1]:
                self.partial[path] = lines[-1]
            for line in lines[:-1]:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("f") == "acquire" and e.get("kind") == "ok" and e.get("key") in self.answers:
                    hist = self.answers[e["key"]]
                    hist.append((e["t"], i, e["resp"]))
                    del hist[:-30]

    # ------------------------------------------------------------ running
    def start(self, seconds):
        self.end = time.monotonic() + seconds
        self.thread = threading.Thread(target=self.run, name="fuzzer", daemon=True)
        self.thread.start()

    def stop(self):
        self.stop_flag.set()
        if self.thread:
            self.thread.join(30)
        for sidecar_i, key, resp in self.own:
            self.release_own(sidecar_i, key, resp)
        self.own = []
        self.hist.close()

    def run(self):
        gap = self.opts.get("gap_ms", (10, 60))
        while not self.stop_flag.is_set() and time.monotonic() < self.end:
            try:
                self.poll_histories()
                self.one()
            except Exception as e:  # a fuzzer bug must not end the run silently
                self.log("info", "fuzz_error", error=repr(e))
            self.stop_flag.wait(self.rng.uniform(*gap) / 1000)

    # ------------------------------------------------------------ tokens
    def answer(self, key, age=0):
        """A worker's acquire answer for `key`: the newest (age 0), or an
        older one (replayed)."""
        hist = self.answers.get(key) or []
        if not hist:
            return None
        return hist[-1 - min(age, len(hist) - 1)]

    def acquire_own(self, key):
        """Takes a lock on a look-alike key through a random sidecar."""
        i = self.rng.randrange(len(self.cluster.sidecars))
        s = self.cluster.sidecars[i]
        # 2 s, but on ZooKeeper the longest lease its 3 s sessions allow
        # (45 % less the lock-delay: 1 350 ms; a longer one is refused and
        # the look-alike recipe would never hold a lease there).
        ttl = 1200 if self.cluster.sc["backend"] == "zookeeper" else 2000
        body = json.dumps({"ttl_ms": ttl, "wait_ms": 0, "owner": "fuzz"}).encode()
        path = f"/v1/locks/{q(key)}/acquire"
        data = (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body
        self.log("invoke", "acquire", key=key, sidecar=i)
        status, resp = raw_request(s.api_port, data, timeout=4)
        if status == 200 and resp.get("fencing_token"):
            self.log("ok", "acquire", key=key, sidecar=i, resp=resp)
            self.own.append((i, key, resp))
            return i, resp
        self.log("fail" if status else "info", "acquire", key=key, sidecar=i, status=status,
                 error=resp.get("error") if isinstance(resp, dict) else resp)
        return None

    def release_own(self, i, key, resp):
        body = json.dumps({"lease_id": resp["lease_id"]}).encode()
        data = (f"POST /v1/locks/{q(key)}/release HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        raw_request(self.cluster.sidecars[i].api_port, data, timeout=3)

    # ------------------------------------------------------------ requests
    def one(self):
        rng = self.rng
        recipe = rng.choices(
            ["method", "path", "framing", "dup_header", "token", "lookalike", "proxy"],
            weights=self.opts.get("weights", [3, 3, 2, 3, 3, 1, 3]))[0]
        key = rng.choice(self.keys)
        other = rng.choice([k for k in self.keys if k != key] or self.keys)
        ans = self.answer(key, 0 if rng.random() < 0.7 else rng.randrange(1, 10))
        cur = ans[2]["fencing_token"] if ans else None
        method, path, headers, framing, target = "PUT", f"/kv/{q(key)}", [], "cl", "gateway"
        seq = [] if rng.random() < 0.5 else [("Fencing-Seq", str(rng.choice([1, 2, 3, 50, 10**6])))]
        what = {}
        if recipe == "method":
            method = rng.choice(METHODS_EXT + METHODS_BAD if rng.random() < 0.85 else ["PUT", "POST", "PATCH"])
            if cur and rng.random() < 0.4:
                headers = [("Fencing-Token", cur), ("Fencing-Key", key)] + seq
        elif recipe == "path":
            label, path = rng.choice(path_variants(key if rng.random() < 0.8 else other))
            what["path_form"] = label
            if cur:
                headers = [("Fencing-Token", cur)] + ([("Fencing-Key", key)] if rng.random() < 0.5 else []) + seq
            method = rng.choice(["PUT", "PUT", "POST", "MOVE", "put"])
        elif recipe == "framing":
            framing = rng.choice(["chunked", "cl_short", "cl_long", "both", "gzip", "gzip_chunked"])
            if cur and rng.random() < 0.7:
                headers = [("Fencing-Token", cur), ("Fencing-Key", key)] + seq
            method = rng.choice(["PUT", "MOVE", "put", "PATCH"])
        elif recipe == "dup_header":
            second = self.second_token(key, other, cur)
            form = rng.choice(["two_lines", "two_cases", "comma", "folded", "dup_seq", "dup_key"])
            what["header_form"] = form
            first = cur or second
            if form == "two_lines":
                headers = [("Fencing-Token", first), ("Fencing-Token", second)]
            elif form == "two_cases":
                headers = [("Fencing-Token", first), ("FENCING-token", second)]
            elif form == "comma":
                headers = [("Fencing-Token", f"{first}, {second}")]
            elif form == "folded":
                headers = [("Fencing-Token", f"{first}\r\n {second}")]
            elif form == "dup_seq":
                headers = [("Fencing-Token", first), ("Fencing-Seq", "1000000"), ("fencing-seq", "1")]
            else:
                headers = [("Fencing-Token", first), ("Fencing-Key", key), ("Fencing-Key", other)]
            if form != "dup_seq" and rng.random() < 0.3:
                headers += seq
            if rng.random() < 0.3:
                method = rng.choice(["POST", "PATCH", "MOVE"])
        elif recipe == "token":
            form = rng.choice(["replayed", "inflated", "inflated_small", "other_key", "other_key_header",
                               "retargeted", "garbage", "empty"])
            what["token_form"] = form
            old = self.answer(key, rng.randrange(2, 12))
            tok = {
                "replayed": old[2]["fencing_token"] if old else None,
                "inflated": inflate(cur, 1 << 40) if cur else None,
                "inflated_small": inflate(cur, 1) if cur else None,
                "other_key": cur, "other_key_header": cur,
                "retargeted": retarget(cur, other) if cur else None,
                "garbage": "v2.k1.99999999999.x.eA.AAAA",
                "empty": "",
            }[form]
            if tok is None:
                tok = "v2.k1.1.tag.YWNjdA.c2ln"
            if form in ("other_key", "other_key_header", "retargeted"):
                path = f"/kv/{q(other)}"
            headers = [("Fencing-Token", tok)] + ([("Fencing-Key", other if form == "other_key_header" else key)]
                                                   if rng.random() < 0.6 else []) + seq
        elif recipe == "lookalike":
            own = [o for o in self.own if o[1] in lookalikes(key)]
            if not own or rng.random() < 0.3:
                got = self.acquire_own(rng.choice(lookalikes(key)))
                if got is None:
                    return
                i, resp = got
                lk = resp.get("key") or ""
            else:
                i, lk, resp = rng.choice(own)
            what["lookalike"] = lk
            path = rng.choice([f"/kv/{q(lk)}", f"/kv/{lk}", f"/kv/{q(key)}"])
            if rng.random() < 0.4:
                # Through the proxy of the sidecar that holds it.
                target = ("proxy", i)
                headers = [("Fencing-Lease", resp["lease_id"])]
            else:
                headers = [("Fencing-Token", resp["fencing_token"])] + seq
        elif recipe == "proxy":
            i = ans[1] if ans and rng.random() < 0.8 else rng.randrange(len(self.cluster.sidecars))
            target = ("proxy", i)
            lease = ans[2]["lease_id"] if ans else "AAAAAAAAAAAAAAAAAAAAAA"
            form = rng.choice(["lease", "dup_lease", "dup_lock", "lock_only", "lease_and_token", "method",
                               "path", "lookalike_lock"])
            what["proxy_form"] = form
            if form == "lease":
                headers = [("Fencing-Lease", lease)]
            elif form == "dup_lease":
                headers = [("Fencing-Lease", lease), ("fencing-lease", "AAAAAAAAAAAAAAAAAAAAAA")]
            elif form == "dup_lock":
                headers = [("Fencing-Lease", lease), ("Fencing-Lock", key), ("Fencing-Lock", other)]
            elif form == "lock_only":
                headers = [("Fencing-Lock", key)]
            elif form == "lease_and_token":
                headers = [("Fencing-Lease", lease), ("Fencing-Token", inflate(cur, 1 << 40) if cur else "x")]
            elif form == "method":
                headers = [("Fencing-Lease", lease)] if rng.random() < 0.5 else []
                method = rng.choice(METHODS_EXT)
            elif form == "path":
                headers = [("Fencing-Lease", lease)]
                label, path = rng.choice(path_variants(key if rng.random() < 0.7 else other))
                what["path_form"] = label
            else:
                headers = [("Fencing-Lease", lease), ("Fencing-Lock", rng.choice(lookalikes(key)))]
        self.send(recipe, target, method, path, headers, framing, key, what)

    def second_token(self, key, other, cur):
        """The second value of a duplicated Fencing-Token: one the gateway
        must never let reach the storage."""
        choice = self.rng.choice(["inflated", "replayed", "other_key", "retargeted"])
        if choice == "replayed":
            old = self.answer(key, self.rng.randrange(2, 12))
            if old and old[2]["fencing_token"] != cur:
                return old[2]["fencing_token"]
        if choice == "other_key":
            ans = self.answer(other, 0)
            if ans:
                return ans[2]["fencing_token"]
        if choice == "retargeted" and cur:
            return retarget(cur, other)
        return inflate(cur, 1 << 40) if cur else "v2.k1.1099511627776.tag.YWNjdA.c2ln"

    def send(self, recipe, target, method, path, headers, framing, key, what):
        self.n += 1
        op_id = f"fz-{self.n}"
        body = json.dumps({"balance": 0, "op_id": op_id, "prev": -1, "fuzz": True}).encode()
        if target == "gateway":
            g = self.rng.randrange(len(self.cluster.gateways))
            port, target_name = self.cluster.gateways[g].api_port, self.cluster.gateways[g].name
        else:
            port, target_name = self.cluster.sidecars[target[1]].proxy_port, f"proxy-{target[1]}"
        h = [("Host", "storage"), ("Connection", "close"), ("Content-Type", "application/json")] + list(headers)
        if framing in ("gzip", "gzip_chunked"):
            body = gzip.compress(body)
            h.append(("Content-Encoding", "gzip"))
        if framing in ("chunked", "gzip_chunked"):
            h.append(("Transfer-Encoding", "chunked"))
            cut = self.rng.randrange(1, len(body))
            parts = (body[:cut], body[cut:])
            payload = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts) + b"0\r\n\r\n"
        elif framing == "cl_short":
            h.append(("Content-Length", str(len(body) - 5)))
            payload = body
        elif framing == "cl_long":
            h.append(("Content-Length", str(len(body) + 10)))
            payload = body
        elif framing == "both":
            h += [("Content-Length", str(len(body))), ("Transfer-Encoding", "chunked")]
            payload = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        else:
            h.append(("Content-Length", str(len(body))))
            payload = body
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in h) + "\r\n"
        data = head.encode("utf-8", "surrogateescape") + payload
        kv = dict(op_id=op_id, recipe=recipe, target=target_name, method=method[:40], path=path[:200],
                  framing=framing, key=key, **what)
        kv["headers"] = [(n, v[:120]) for n, v in headers]
        self.log("invoke", "fuzz", **kv)
        status, resp = raw_request(port, data)
        kv.pop("headers")
        if status is None:
            self.log("info", "fuzz", error=resp, **kv)
        elif status < 300:
            self.log("ok", "fuzz", status=status, **kv)
        elif status in UNKNOWN:
            self.log("info", "fuzz", status=status, error=resp.get("error"), **kv)
        else:
            self.log("fail", "fuzz", status=status, error=resp.get("error"), **kv)


def stats(events, commits):
    """Bite metrics of a fuzzed run: requests sent, refused (and by status
    and code), applied (fuzz rows in the commit log) and unknown."""
    out = [e for e in events if e["f"] == "fuzz" and e["kind"] != "invoke"]
    refused = {}
    for e in out:
        if e["kind"] == "fail":
            k = f"{e.get('status')} {e.get('error') or '-'}"
            refused[k] = refused.get(k, 0) + 1
    return {
        "fuzz_requests": len(out),
        "fuzz_refused": sum(refused.values()),
        "fuzz_applied": sum(1 for c in commits if c.get("fuzz")),
        "fuzz_unknown": sum(1 for e in out if e["kind"] == "info"),
        "fuzz_answered_ok": sum(1 for e in out if e["kind"] == "ok"),
        "fuzz_lookalike_leases": sum(1 for e in events if e["f"] == "acquire" and e["kind"] == "ok"),
    }, dict(sorted(refused.items(), key=lambda kv: -kv[1]))
