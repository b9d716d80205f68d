"""etcd members a fault-suite run starts and owns (issue 34): n members
(default 3) on free loopback ports in the run dir, from the Debian
`etcd-server` package.

Why our own: the gateway's etcd fence store is only as safe as its
behaviour across leader elections, so the nemesis must be able to kill
(SIGKILL) and restart the leader and time what follows. Every member is a
`Proc` this class spawned, signalled only through that handle (never by
name), and `stop()` kills them all.

Data lives on /dev/shm where there is one: etcd fsyncs every commit and
3.4 cannot be told not to; a kill -9 keeps tmpfs, as a disk would.
Timing: heartbeat 50 ms, election timeout 500 ms. Readiness is asked with
`POST /v3/maintenance/status` (the JSON gateway): a member names itself
and the leader it follows (0 while electing).
"""
import base64
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request

from .procs import Proc, free_port, wait_for

ETCD = "/usr/bin/etcd"
START_TIMEOUT = 30
PROBE_TIMEOUT = 0.7


def post(port, path, body, timeout=PROBE_TIMEOUT):
    """POST a JSON body to a member's gateway; the parsed answer, or None."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except Exception:
        return None


class EtcdCluster:
    """n etcd members, started by the constructor; returns once every
    member answers and follows one leader, or raises with the log tails
    after 30 s. Member i has client port `ports[i]`; a restart keeps its
    ports and data. If a member cannot bind a port at first start, the
    whole cluster starts again on fresh ports."""

    def __init__(self, run_dir, n=3, name="etcd"):
        self.n, self.name = n, name
        base = "/dev/shm" if os.path.isdir("/dev/shm") else run_dir
        self.data_root = tempfile.mkdtemp(prefix="fencer-faults-etcd-", dir=base)
        self.log_dir = os.path.join(run_dir, name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs = []
        for attempt in range(3):
            self.ports = [free_port() for _ in range(n)]
            self.peer_ports = [free_port() for _ in range(n)]
            self.procs = [self._proc(i) for i in range(n)]
            for p in self.procs:
                p.start()
            try:
                self.wait_healthy(START_TIMEOUT)
                return
            except RuntimeError:
                logs = self.logs()
                self.stop(remove=False)
                if "address already in use" not in logs or attempt == 2:
                    raise
                for i in range(n):
                    shutil.rmtree(os.path.join(self.data_root, f"m{i}"), ignore_errors=True)

    def _proc(self, i):
        cluster = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        client, peer = f"http://127.0.0.1:{self.ports[i]}", f"http://127.0.0.1:{self.peer_ports[i]}"
        argv = [ETCD, "--name", f"m{i}", "--data-dir", os.path.join(self.data_root, f"m{i}"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", "fencer-faults", "--heartbeat-interval", "50",
                "--election-timeout", "500", "--logger", "zap", "--log-level", "warn"]
        return Proc(f"{self.name}-{i}", argv, dict(os.environ), os.path.join(self.log_dir, f"m{i}.log"))

    def endpoints(self):
        return ",".join(f"http://127.0.0.1:{p}" for p in self.ports)

    def status(self, i):
        """Member i's status (member_id, leader, raft_term) or None."""
        if not self.procs[i].alive():
            return None
        s = post(self.ports[i], "/v3/maintenance/status", {})
        if s is None:
            return None
        num = lambda v: int(v or 0)  # noqa: E731 — the gateway leaves zeros out
        return num(s.get("header", {}).get("member_id")), num(s.get("leader")), num(s.get("raftTerm"))

    def try_leader(self):
        leaders = []
        for i in range(self.n):
            s = self.status(i)
            if s and s[1] and s[0] == s[1]:
                leaders.append((s[2], i))
        return max(leaders)[1] if leaders else None

    def leader(self, timeout=START_TIMEOUT):
        found = {}

        def look():
            found["i"] = self.try_leader()
            return found["i"] is not None
        self._wait("an etcd leader", timeout, look)
        return found["i"]

    def wait_new_leader(self, old, timeout=START_TIMEOUT):
        found = {}

        def look():
            found["i"] = self.try_leader()
            return found["i"] not in (None, old)
        self._wait(f"an etcd leader other than m{old}", timeout, look, poll=0.01)
        return found["i"]

    def healthy(self):
        """Every member answers and follows the same leader."""
        st = [self.status(i) for i in range(self.n)]
        return all(st) and st[0][1] != 0 and all(s[1] == st[0][1] for s in st)

    def wait_healthy(self, timeout=START_TIMEOUT):
        self._wait("etcd healthy", timeout, self.healthy, poll=0.05)

    def kill(self, i):
        """SIGKILL member i; returns the monotonic ns of the kill."""
        p = self.procs[i]
        p.resume()
        p.signal(signal.SIGKILL)
        t = time.monotonic_ns()
        if p.p is not None:
            try:
                p.p.wait(timeout=10)
            except Exception:
                pass
        return t

    def kill_leader(self):
        i = self.leader()
        return i, self.kill(i)

    def restart(self, i, timeout=START_TIMEOUT):
        """Starts member i again on its ports and data; returns once it
        answers with a leader."""
        if self.procs[i].alive():
            self.kill(i)
        self.procs[i].start()
        self._wait(f"m{i} back", timeout, lambda: (self.status(i) or (0, 0, 0))[1] != 0)

    def marks(self, prefix="/fencer/fence/marks/"):
        """The fence store's marks: {key: write token}."""
        key = prefix.encode()
        end = key[:-1] + bytes([key[-1] + 1])
        for i in range(self.n):
            r = post(self.ports[i], "/v3/kv/range",
                     {"key": base64.b64encode(key).decode(), "range_end": base64.b64encode(end).decode()})
            if r is not None:
                out = {}
                for kv in r.get("kvs", []):
                    k = base64.b64decode(kv["key"]).decode()[len(prefix):]
                    out[k] = int(base64.b64decode(kv.get("value", "")).decode().split(" ")[0])
                return out
        return {}

    def stop(self, remove=True):
        for i in range(len(self.procs)):
            self.kill(i)
        if remove:
            shutil.rmtree(self.data_root, ignore_errors=True)

    def _wait(self, what, timeout, check, poll=0.02):
        try:
            wait_for(what, timeout, check, poll=poll)
        except RuntimeError:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}:\n{self.logs()}") from None

    def logs(self, lines=25):
        out = []
        for i, p in enumerate(self.procs):
            tail = p.logs().splitlines()[-lines:]
            out.append(f"--- {self.name}-{i} client port {self.ports[i]} pid {p.pid}\n" + "\n".join(tail))
        return "\n".join(out)
