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

Run as: python3 -m harness.storage --port N --db PATH
"""
import argparse
import json
import sqlite3
import threading
import time
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
    return db


def parse_token(raw):
    if not raw:
        return None, None
    parts = raw.split(".")
    if len(parts) != 6:
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
                                  "claimed_prev, t_ns, method FROM log ORDER BY commit_seq").fetchall()
            cols = ["commit_seq", "key", "token", "seq", "lease", "prev", "new", "op_id",
                    "claimed_prev", "t_ns", "method"]
            return self.reply(200, {"log": [dict(zip(cols, r)) for r in rows]})
        if self.path.startswith("/kv/"):
            key = urllib.parse.unquote(self.path[4:])
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
        self.reply(404, {"error": "not_found"})

    def do_PUT(self):
        if not self.path.startswith("/kv/"):
            return self.reply(404, {"error": "not_found"})
        key = urllib.parse.unquote(self.path[4:])
        raw = self.body()
        try:
            req = json.loads(raw)
            new = int(req["balance"])
        except (ValueError, KeyError, TypeError):
            return self.reply(400, {"error": "bad_body"})
        token, lease = parse_token(self.headers.get("fencing-token"))
        seq = self.headers.get("fencing-seq")
        delay = int(self.headers.get("x-delay-ms") or STATE["delay_ms"])
        if delay:
            time.sleep(delay / 1000)
        db = self.server.db
        with LOCK:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT balance FROM kv WHERE key = ?", (key,)).fetchone()
            prev = row[0] if row else 0
            db.execute("INSERT INTO kv (key, balance) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                       "SET balance = excluded.balance", (key, new))
            db.execute("INSERT INTO log (key, token, seq, lease, prev, new, op_id, claimed_prev, t_ns, method) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (key, token, int(seq) if seq else None, lease, prev, new, req.get("op_id"),
                        req.get("prev"), time.monotonic_ns(), "PUT"))
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
