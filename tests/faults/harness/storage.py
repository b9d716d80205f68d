"""The toy storage of the fault suite: account balances, and the commit log
that is the authoritative order of applied writes.

    GET  /kv/<account>          {"balance": n}        (404 when never written)
    PUT  /kv/<account>          {"balance": n, "op_id": s, "prev": p}
    GET  /_log                  every commit, in commit order
    POST /_control              {"delay_ms": n}: hold every write n ms first
    GET  /healthz

A write is applied in one SQLite transaction together with its commit-log
row: (commit_seq, key, token, seq, lease tag, prev, new, op_id, claimed
prev). `prev` is the balance the storage had, `new` the one written: a lost
update shows as new != prev + 1. A write is applied even if its sender hung
up while it waited (like a real storage that received it).

The storage is deliberately **lenient**, like the storages fencer must
protect (issue 28: the gateway fuzzer): every method but GET and HEAD (any
case: `put`, MOVE, PROPPATCH, BREW) with a JSON body is a write; a path
is read the way servlet, Spring and Unicode-folding storages read it
(`canonical_key`: `;` parameters dropped, percent-decoded twice, NFKC,
`//`, `.` and `..` resolved, a trailing `/` and a `.json` suffix
dropped); a chunked or gzip-encoded body is decoded; of a header sent
twice the *last* value is used (the gateway checks the first). The
commit log records the canonical key and the raw token as received, so
the checker can tell whether what landed was fenced for exactly that key.
A write whose body says `"fuzz": true` (the fuzzer's) is recorded but
leaves the balance alone: the ledger chain (S4) is the workers'.

Run as: python3 -m harness.storage --port N --db PATH
"""
import argparse
import gzip
import json
import sqlite3
import threading
import time
import unicodedata
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {"delay_ms": 0}


def open_db(path):
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, balance INTEGER NOT NULL)")
    db.execute("""CREATE TABLE IF NOT EXISTS log (
        commit_seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT, token INTEGER, seq INTEGER,
        lease TEXT, prev INTEGER, new INTEGER, op_id TEXT, claimed_prev INTEGER,
        t_ns INTEGER, method TEXT)""")
    cols = {r[1] for r in db.execute("PRAGMA table_info(log)")}
    for col in ("raw_token TEXT", "raw_path TEXT", "fuzz INTEGER"):
        if col.split()[0] not in cols:
            db.execute(f"ALTER TABLE log ADD COLUMN {col}")
    return db


def canonical_key(raw_path):
    """The object a lenient storage reads `raw_path` (`/kv/<key>...`) as,
    or None if it names no object under /kv/."""
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    if "://" in path:  # an absolute-form request target
        path = "/" + path.split("://", 1)[1].partition("/")[2]
    path = "/".join(seg.split(";", 1)[0] for seg in path.split("/"))
    for _ in range(2):  # double decoding: `%252D` is `-`
        path = urllib.parse.unquote(path)
    path = "/".join(seg.split(";", 1)[0] for seg in path.split("/"))
    path = unicodedata.normalize("NFKC", path)
    out = []
    for seg in path.replace("\\", "/").split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    if len(out) < 2 or out[0] != "kv":
        return None
    key = "/".join(out[1:])
    if key.endswith(".json"):
        key = key[:-5]
    return key or None


def last_header(headers, name):
    """The last value of a header sent several times (the gateway checks
    the first: the storage must not agree by accident)."""
    vals = headers.get_all(name) or []
    return vals[-1] if vals else None


def parse_token(raw):
    if not raw:
        return None, None
    parts = raw.split(".")
    # v2 (a write lease's) has 6 parts; v3 (a read lease's) 7, the mode
    # before the signature.
    if len(parts) not in (6, 7):
        return None, None
    try:
        return int(parts[2]), parts[3]
    except ValueError:
        return None, None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:
            pass

    def body(self):
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def do_GET(self):
        db = self.server.db
        if self.path == "/healthz":
            return self.reply(200, {"status": "ok"})
        if self.path == "/_log":
            with LOCK:
                rows = db.execute("SELECT commit_seq, key, token, seq, lease, prev, new, op_id, "
                                  "claimed_prev, t_ns, method, raw_token, raw_path, fuzz "
                                  "FROM log ORDER BY commit_seq").fetchall()
            cols = ["commit_seq", "key", "token", "seq", "lease", "prev", "new", "op_id",
                    "claimed_prev", "t_ns", "method", "raw_token", "raw_path", "fuzz"]
            return self.reply(200, {"log": [dict(zip(cols, r)) for r in rows]})
        if self.path.startswith("/kv/"):
            key = canonical_key(self.path)
            with LOCK:
                row = db.execute("SELECT balance FROM kv WHERE key = ?", (key,)).fetchone()
            if row is None:
                return self.reply(404, {"error": "not_found"})
            return self.reply(200, {"balance": row[0]})
        self.reply(404, {"error": "not_found"})

    def do_POST(self):
        if self.path == "/_control":
            STATE.update(json.loads(self.body() or b"{}"))
            return self.reply(200, STATE)
        self.do_PUT()

    def __getattr__(self, name):
        # Every other method (MOVE, PROPPATCH, `put`, BREW...) is a write
        # here, like a WebDAV or case-folding storage.
        if name.startswith("do_") and name[3:].upper() not in ("GET", "HEAD"):
            return self.do_PUT
        raise AttributeError(name)

    def raw_body(self):
        """The request body, chunked or not, gzip-decoded if so encoded."""
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            data = b""
            while True:
                line = self.rfile.readline(1024)
                n = int(line.split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                data += self.rfile.read(n)
                self.rfile.readline(8)
        else:
            data = self.body()
        if (self.headers.get("content-encoding") or "").lower() == "gzip":
            data = gzip.decompress(data)
        return data

    def do_PUT(self):
        # The body is read first, whatever the answer: a body left unread
        # would be parsed as the next request on this keep-alive connection.
        try:
            raw = self.raw_body()
        except Exception:  # a malformed chunk, a bad gzip stream, a cut body
            self.close_connection = True
            return self.reply(400, {"error": "bad_body"})
        key = canonical_key(self.path)
        if key is None:
            return self.reply(404, {"error": "not_found"})
        try:
            req = json.loads(raw)
            new = int(req["balance"])
        except (ValueError, KeyError, TypeError):
            return self.reply(400, {"error": "bad_body"})
        raw_token = last_header(self.headers, "fencing-token")
        token, lease = parse_token(raw_token)
        seq = last_header(self.headers, "fencing-seq")
        try:
            seq = int(seq) if seq else None
        except ValueError:
            seq = -1
        fuzz = bool(req.get("fuzz"))
        delay = int(self.headers.get("x-delay-ms") or STATE["delay_ms"])
        if delay:
            time.sleep(delay / 1000)
        db = self.server.db
        with LOCK:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT balance FROM kv WHERE key = ?", (key,)).fetchone()
            prev = row[0] if row else 0
            if fuzz:
                new = prev
            db.execute("INSERT INTO kv (key, balance) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                       "SET balance = excluded.balance", (key, new))
            db.execute("INSERT INTO log (key, token, seq, lease, prev, new, op_id, claimed_prev, t_ns, method, "
                       "raw_token, raw_path, fuzz) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (key, token, seq, lease, prev, new, req.get("op_id"),
                        req.get("prev"), time.monotonic_ns(), self.command, raw_token, self.path, int(fuzz)))
            db.execute("COMMIT")
        self.reply(200, {"balance": new, "prev": prev})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--db", required=True)
    a = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    srv.daemon_threads = True
    srv.db = open_db(a.db)
    srv.serve_forever()


if __name__ == "__main__":
    main()
