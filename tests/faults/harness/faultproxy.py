"""Loopback TCP fault proxies: one in front of every link of a run.

Each proxy forwards bytes both ways until the nemesis sets a mode:
  pass            forward
  delay           hold every chunk `ms` before forwarding (`direction`: both, up, down)
  blackhole       accept and hold every byte, forward nothing (a partition that
                  keeps sockets open; new connections are accepted and held too)
  drop_down       forward client→server, drop server→client (one-way loss: the
                  request arrives, its answer never does)
  freeze_unscripted  hold connections that never sent a Redis script command
                  (the pub/sub connection: a half-open subscriber)
  late_reply      once: the next request chunk (on any connection; with
                  `marker`, the next one containing those bytes) is forwarded
                  at once (`marker` may be a list: every one of them; none
                  of the list `unless`), and
                  the first answer chunk on its connection after
                  it is held `ms`, then delivered; then back to `pass`. The
                  request reaches the server and is applied; only its *reply*
                  comes late (past the caller's timeout: PITFALLS 11)
  late_request    once: the next request chunk (markers as for late_reply)
                  is held `ms` before it is forwarded — with every later
                  chunk of its connection queued behind it, as TCP keeps
                  their order — then delivered (its reply follows when the
                  server gives one); then back to `pass`. The statement
                  reaches the server after its caller gave up (issue 28):
                  delivered even if the caller closed the connection
                  meanwhile, as a kernel delivers bytes sent before a FIN
and `reset_all()` closes every open connection with a TCP RST (bytes a
held connection was holding are dropped, never delivered later).

All proxies of a run live in one background thread running an asyncio loop.
"""
import asyncio
import socket
import struct
import threading
import time

from .procs import free_port

# The most of a late request's bytes its events record (printable form).
LATE_TEXT_MAX = 4096


class _Loop:
    _instance = None

    @classmethod
    def get(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        t = threading.Thread(target=self.loop.run_forever, daemon=True, name="faultproxies")
        t.start()

    def run(self, coro, timeout=10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def _rst(writer):
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.close()


class FaultProxy:
    def __init__(self, name, target_port, events=None):
        self.name = name
        self.target_port = target_port
        self.port = free_port()
        self.mode = {"mode": "pass"}
        self.events = events
        self.conns = []
        self._loop = _Loop.get()
        self.server = self._loop.run(self._start())

    async def _start(self):
        return await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    def set(self, mode, **params):
        self.mode = dict(params, mode=mode)
        if self.events:
            self.events(kind="proxy", proxy=self.name, mode=mode, **params)

    def reset_all(self):
        if self.events:
            self.events(kind="proxy", proxy=self.name, mode="reset")

        async def go():
            for c in list(self.conns):
                c["dead"] = True
                for w in c["writers"]:
                    _rst(w)
            self.conns.clear()
        self._loop.run(go())

    def close(self):
        async def go():
            self.server.close()
            for c in list(self.conns):
                c["dead"] = True
                for w in c["writers"]:
                    _rst(w)
        try:
            self._loop.run(go())
        except Exception:
            pass

    def _held(self, conn):
        m = self.mode["mode"]
        if m == "blackhole":
            return True
        if m == "freeze_unscripted":
            return not conn["scripted"]
        return False

    async def _handle(self, creader, cwriter):
        try:
            sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _rst(cwriter)
            return
        conn = {"scripted": False, "writers": [cwriter, swriter], "late_ms": None}
        self.conns.append(conn)
        up = asyncio.ensure_future(self._pump(creader, swriter, conn, up=True))
        down = asyncio.ensure_future(self._pump(sreader, cwriter, conn, up=False))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in conn["writers"]:
            w.close()
        if conn in self.conns:
            self.conns.remove(conn)

    def _arm_late_reply(self, conn, chunk):
        """late_reply: this request's connection gets its next reply held
        (once per arming; the proxy is back to `pass` at once)."""
        m = self.mode
        if m["mode"] != "late_reply" or conn.get("dead"):
            return
        markers = m.get("marker") or []
        if isinstance(markers, str):
            markers = [markers]
        if any(x.encode() not in chunk for x in markers):
            return
        if any(x.encode() in chunk for x in m.get("unless") or []):
            return
        self.mode = {"mode": "pass"}
        conn["late_ms"] = m.get("ms", 0)
        # What the held reply answers, for the record (printable bytes).
        conn["late_req"] = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk[:120])

    def _late_request_hold(self, chunk):
        """late_request: how long to hold this request chunk (0: not the
        one). Disarms the proxy (back to `pass`) when it fires."""
        m = self.mode
        if m["mode"] != "late_request":
            return 0
        markers = m.get("marker") or []
        if isinstance(markers, str):
            markers = [markers]
        if any(x.encode() not in chunk for x in markers):
            return 0
        if any(x.encode() in chunk for x in m.get("unless") or []):
            return 0
        self.mode = {"mode": "pass"}
        return m.get("ms", 0)

    async def _deliver_late(self, ms, chunk, writer, conn):
        """Holds a late request `ms`, then forwards it; records both ends
        (`late_request_fired`, `late_request_delivered`, with the request's
        printable bytes: the nemesis finds its key there)."""
        # Up to 4 KiB: the checker (late_requests.check) looks for the lease
        # id a late statement names, and a shared statement names several.
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk[:LATE_TEXT_MAX])
        t_fired = time.monotonic_ns()
        if self.events:
            self.events(kind="late_request_fired", proxy=self.name, ms=ms, request=text[:160])
        await asyncio.sleep(ms / 1000)
        if conn.get("dead"):
            return False
        try:
            writer.write(chunk)
            await writer.drain()
        except (ConnectionError, OSError):
            return False
        if self.events:
            self.events(kind="late_request_delivered", proxy=self.name, ms=ms, fired=t_fired, request=text,
                        whole=len(chunk) <= LATE_TEXT_MAX)
        return True

    async def _pump(self, reader, writer, conn, up):
        while True:
            try:
                chunk = await reader.read(65536)
            except (ConnectionError, OSError):
                return
            if not chunk:
                try:
                    writer.write_eof()
                except (OSError, RuntimeError):
                    pass
                return
            if up:
                u = chunk.upper()
                if b"EVAL" in u or b"SCRIPT" in u:
                    conn["scripted"] = True
                self._arm_late_reply(conn, chunk)
                late = self._late_request_hold(chunk)
                if late:
                    if not await self._deliver_late(late, chunk, writer, conn):
                        return
                    continue
            while self._held(conn) and not conn.get("dead"):
                await asyncio.sleep(0.005)
            if conn.get("dead"):
                return  # reset while held: the bytes die with the connection
            if not up and conn["late_ms"] is not None:
                # The one reply late_reply holds: later chunks of this
                # connection queue behind it (TCP keeps their order).
                ms, conn["late_ms"] = conn["late_ms"], None
                if self.events:
                    self.events(kind="late_reply_fired", proxy=self.name, ms=ms, request=conn.get("late_req"))
                await asyncio.sleep(ms / 1000)
                if conn.get("dead"):
                    return
            m = self.mode
            if m["mode"] == "delay" and m.get("direction", "both") in ("both", "up" if up else "down"):
                await asyncio.sleep(m.get("ms", 0) / 1000)
            if m["mode"] == "drop_down" and not up:
                continue
            try:
                writer.write(chunk)
                await writer.drain()
            except (ConnectionError, OSError):
                return
