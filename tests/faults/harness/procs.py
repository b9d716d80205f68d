"""The processes of a fault-suite run: services it starts and owns.

Every process is started by the harness on free loopback ports in the run's
own directory, and is paused, killed or restarted only through the handle
that started it (never by name). PostgreSQL is a family of processes: its
pause/kill act on the postmaster and its children, the way a frozen or
crashed machine would.
"""
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

# The repository root (binary, cargo tests, default --out). FENCER_ROOT
# overrides it for a copy of the suite kept outside the repository.
ROOT = os.environ.get("FENCER_ROOT") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SECRET = "fault-suite-secret-0123456789-abcdefghijklmnop"
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def faketime_env(offset):
    """The environment that offsets a process's wall clock (libfaketime;
    its monotonic clock is left alone). Without the library the loader only
    warns and the process runs on the real clock — a clock-offset run that
    offset nothing — so its absence is an error."""
    if not os.path.exists(FAKETIME):
        raise RuntimeError(f"{FAKETIME} missing (Debian package faketime; tests/run.sh installs it)")
    return {"LD_PRELOAD": FAKETIME, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1"}

_used_ports = set()


def _port_range():
    """The ports this process may take: 10000–30000, or the slice
    `FENCER_FAULTS_PORTS=lo-hi` that `run.py --jobs` gives each of its job
    processes (`_used_ports` keeps one process from reusing a port; the
    slices keep processes apart)."""
    lo, _, hi = os.environ.get("FENCER_FAULTS_PORTS", "10000-30000").partition("-")
    return int(lo), int(hi)


def free_port():
    """A free port below the kernel's ephemeral range (outgoing connections
    never take it between our check and the bind)."""
    for _ in range(1000):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        lo, hi = _port_range()
        p = lo + (p % (hi - lo))
        if p in _used_ports:
            continue
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            t.close()
        _used_ports.add(p)
        return p
    raise RuntimeError("no free port")


def wait_for(what, timeout, check, poll=0.02):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(poll)
    raise RuntimeError(f"timed out waiting for {what}")


def http_ok(url, timeout=1.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rfind(")") + 2]
    except OSError:
        return None


def children_of(parent):
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            out.append(int(name))
    return out


class Proc:
    """One child process with its log file."""

    def __init__(self, name, argv, env, log_path, cwd=None, preexec=None):
        self.name, self.argv, self.env, self.log_path, self.cwd = name, argv, env, log_path, cwd
        self.preexec = preexec
        self.p = None

    def start(self):
        log = open(self.log_path, "ab")
        self.p = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=log,
                                  stdin=subprocess.DEVNULL, cwd=self.cwd, preexec_fn=self.preexec)
        log.close()

    @property
    def pid(self):
        return self.p.pid if self.p else None

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            try:
                os.kill(self.p.pid, sig)
            except ProcessLookupError:
                pass

    def pause(self):
        self.signal(signal.SIGSTOP)

    def resume(self):
        self.signal(signal.SIGCONT)

    def kill(self):
        if self.p is None:
            return
        self.resume()
        self.signal(signal.SIGKILL)
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self, timeout=15):
        if not self.alive():
            return
        self.resume()
        self.signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def logs(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


class Redis:
    def __init__(self, run_dir, name="redis", aof=True, args=()):
        self.dir = os.path.join(run_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log")]
        argv += ["--appendonly", "yes", "--appendfsync", "always"] if aof else ["--appendonly", "no"]
        argv += list(args)  # e.g. maxmemory and its policy (harness/eviction.py)
        self.proc = Proc(name, argv, dict(os.environ), os.path.join(self.dir, "stdout.log"))
        self.start()

    def start(self):
        self.proc.start()
        wait_for("redis", 10, lambda: self.cmd("PING") == "+PONG")

    def url(self, port=None):
        return f"redis://127.0.0.1:{port or self.port}/0"

    def cmd(self, *args):
        """One command over a raw RESP connection; returns the reply line."""
        s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        try:
            req = f"*{len(args)}\r\n" + "".join(f"${len(str(a))}\r\n{a}\r\n" for a in args)
            s.sendall(req.encode())
            return s.recv(65536).decode(errors="replace").split("\r\n")[0]
        finally:
            s.close()

    def restart(self):
        self.proc.kill()
        self.start()

    def stop(self):
        self.proc.kill()


class RedLockMasters:
    """The independent masters of `backend.kind = "redlock"` (no replication
    between them), each a `Redis` in the run dir. Without AOF (the default
    here) a restarted master is empty: the case that breaks naive RedLock.

    A brand-new deployment's masters are vouched for at start (their
    data-age marker set to 0, the operator's first-deployment step in
    docs/runbooks.md), so the run does not begin with every master in its
    restart quarantine; a master restarted during the run is not."""

    AGE_KEY = "fencer:redlock:data-age"

    def __init__(self, run_dir, n=5, aof=False):
        self.masters = [Redis(run_dir, f"redlock-{i}", aof=aof) for i in range(n)]
        self.ports = [m.port for m in self.masters]
        self.proxies = []
        for m in self.masters:
            m.cmd("SET", self.AGE_KEY, "0")

    def kill_restart(self, i):
        """kill -9 master i and start it again at once on its port: with no
        AOF it comes back without any lock, counter or age marker."""
        m = self.masters[i]
        t = time.monotonic_ns()
        m.proc.kill()
        m.start()
        return t

    def pause(self, i):
        self.masters[i].proc.pause()

    def resume(self, i):
        self.masters[i].proc.resume()

    def resume_all(self):
        for m in self.masters:
            m.proc.resume()

    def cmd(self, i, *args):
        return self.masters[i].cmd(*args)

    def stop(self):
        for m in self.masters:
            m.stop()


class RespError(Exception):
    """An error reply (`-ERR …`, `-READONLY …`) from Redis."""


def _read_reply(f):
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed mid-reply")
    kind, rest = line[:1], line[1:-2].decode(errors="replace")
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RespError(rest)
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:-2].decode(errors="replace")
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read_reply(f) for _ in range(n)]
    raise ConnectionError(f"unexpected RESP reply {line[:40]!r}")


def resp(port, *args, timeout=1.0):
    """One command on a fresh connection, its whole reply parsed (RESP2):
    sentinels answer with nested arrays, which `Redis.cmd`'s first line
    cannot carry."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        req = f"*{len(args)}\r\n" + "".join(f"${len(str(a).encode())}\r\n{a}\r\n" for a in args)
        s.sendall(req.encode())
        with s.makefile("rb") as f:
            return _read_reply(f)
    finally:
        s.close()


def pairs(flat):
    """A flat `[k1, v1, k2, v2, …]` reply (SENTINEL MASTER) as a dict."""
    return dict(zip(flat[0::2], flat[1::2])) if flat else {}


def info(port, section="replication"):
    """`INFO <section>` as a dict of its `field:value` lines."""
    out = {}
    for line in (resp(port, "INFO", section) or "").splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k] = v.strip()
    return out


def _tagged(key, prefix="fencer:"):
    """`<prefix>{<key with %, { and } percent-escaped>}`: the hash-tagged
    stem of a lock's Redis keys (src/lock/redis/keys.rs)."""
    esc = key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return f"{prefix}{{{esc}}}"


def counter_key(key, prefix="fencer:"):
    """fencer's token counter of a lock key: `<prefix>{<escaped key>}:token`."""
    return _tagged(key, prefix) + ":token"


def lock_key(key, prefix="fencer:"):
    """fencer's lock entry of a lock key: `<prefix>{<escaped key>}:lock`."""
    return _tagged(key, prefix) + ":lock"


def resp_many(port, *cmds, timeout=1.0):
    """Several commands on one fresh connection (pipelined), every reply
    parsed; an error reply is returned as its RespError, not raised, so a
    `READONLY` refused by a master does not hide the `GET` after it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        req = "".join(f"*{len(c)}\r\n" + "".join(f"${len(str(a).encode())}\r\n{a}\r\n" for a in c)
                      for c in cmds)
        s.sendall(req.encode())
        out = []
        with s.makefile("rb") as f:
            for _ in cmds:
                try:
                    out.append(_read_reply(f))
                except RespError as e:
                    out.append(e)
        return out
    finally:
        s.close()


class RedisSentinelSet:
    """One master, two replicas and three sentinels (quorum 2) on free
    loopback ports in the run dir: the topology of `backend.redis.mode =
    "sentinel"`, which the nemesis fails over with kill -9.

    Data nodes keep nothing on disk (`--save ''`, no AOF) and sync diskless,
    so a restarted node is empty and a full sync is immediate. Sentinels
    use `down-after-milliseconds 1000` and `failover-timeout 5000`
    (FAULT-SUITE: promotion ~2.3 s after kill -9).

    Replication links: each replica replicates through a FaultProxy of its
    own (`REPLICAOF 127.0.0.1 <link port>`), so the nemesis can freeze
    replication (bytes held both ways, sockets open) while clients and
    sentinels talk to the master directly — the lossy failover recipe.
    A sentinel "fixes" a replica that points anywhere but the master's own
    address (`+fix-slave-config`, `failover-timeout` after it noticed the
    change), and after a failover it points replicas at the new master
    directly; so `route_links()` re-routes every replica through a fresh
    link (a port the sentinels never saw: the fix is then ≥ 5 s away) right
    before each lossy failover, not just once at start.
    """

    NAME = "fencer"
    FAILOVER_TIMEOUT_MS = 5000

    def __init__(self, run_dir, name="redis-sentinel", replicas=2, sentinels=3, node_args=(), down_after_ms=1000):
        """`down_after_ms` 1000 is FAULT-SUITE's recipe. It equals the
        sentinels' ping period, so right after a switch a sentinel sometimes
        declares the new master down before its first PONG and fails over
        again on its own (measured: 1 in 6–7 kills; none in 6 with 1500,
        promotion then ~2.7 s instead of ~2.3 s)."""
        self.dir = os.path.join(run_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.down_after_ms = down_after_ms
        self.node_args = list(node_args)
        self.nodes = {}      # port -> Proc (data nodes, dead or alive)
        self.links = {}      # replica port -> its current replication-link FaultProxy
        self.sentinels = []  # [(port, Proc)]
        self.n_replicas, self.n_sentinels = replicas, sentinels

    # ------------------------------------------------------------ start/stop

    def _node_argv(self, port, replicaof=None):
        d = os.path.join(self.dir, f"node-{port}")
        os.makedirs(d, exist_ok=True)
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--dir", d, "--logfile", os.path.join(d, "redis.log")] + self.node_args
        if replicaof:
            argv += ["--replicaof", "127.0.0.1", str(replicaof)]
        return argv

    def _start_node(self, port, replicaof=None):
        p = Proc(f"redis-{port}", self._node_argv(port, replicaof), dict(os.environ),
                 os.path.join(self.dir, f"node-{port}", "stdout.log"))
        p.start()
        self.nodes[port] = p
        wait_for(f"redis {port}", 10, lambda: resp(port, "PING") == "PONG")
        return p

    def _link(self, replica, master):
        """A fresh replication link replica → master (closing the old one)."""
        from .faultproxy import FaultProxy  # faultproxy imports this module
        old = self.links.pop(replica, None)
        if old:
            old.close()
        link = FaultProxy(f"repl-link:{replica}", master)
        self.links[replica] = link
        return link

    def start(self):
        """Master, replicas through their links, then the sentinels; returns
        once every sentinel knows the master, both replicas (link ok) and
        the other sentinels."""
        master = free_port()
        self._start_node(master)
        for _ in range(self.n_replicas):
            port = free_port()
            self._start_node(port, replicaof=self._link(port, master).port)
        wait_for("replicas in sync", 20, lambda: self._synced(master))
        for i in range(self.n_sentinels):
            self._start_sentinel(i, master)
        wait_for("sentinels ready", 30, lambda: all(self._sentinel_ready(p, master) for p, _ in self.sentinels))
        return self

    def _start_sentinel(self, i, master):
        port = free_port()
        d = os.path.join(self.dir, f"sentinel-{i}")
        os.makedirs(d, exist_ok=True)
        conf = os.path.join(d, "sentinel.conf")
        with open(conf, "w") as f:
            f.write(f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\ndir {d}\n"
                    f"logfile {os.path.join(d, 'sentinel.log')}\n"
                    f"sentinel monitor {self.NAME} 127.0.0.1 {master} {self.n_sentinels // 2 + 1}\n"
                    f"sentinel down-after-milliseconds {self.NAME} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {self.NAME} {self.FAILOVER_TIMEOUT_MS}\n"
                    f"sentinel parallel-syncs {self.NAME} 1\n")
        p = Proc(f"sentinel-{i}", ["redis-server", conf, "--sentinel"], dict(os.environ),
                 os.path.join(d, "stdout.log"))
        p.start()
        self.sentinels.append((port, p))

    def _sentinel_ready(self, port, master):
        m = pairs(resp(port, "SENTINEL", "MASTER", self.NAME))
        if int(m.get("port", 0)) != master or m.get("flags") != "master":
            return False
        reps = [pairs(r) for r in resp(port, "SENTINEL", "REPLICAS", self.NAME)]
        ok = [r for r in reps if r.get("flags") == "slave" and r.get("master-link-status") == "ok"]
        others = resp(port, "SENTINEL", "SENTINELS", self.NAME)
        return len(ok) == self.n_replicas and len(others) == self.n_sentinels - 1

    def stop(self):
        for _, p in self.sentinels:
            p.kill()
        for p in self.nodes.values():
            p.kill()
        for link in self.links.values():
            link.close()

    # ------------------------------------------------------------ topology

    @property
    def sentinel_addrs(self):
        return [f"127.0.0.1:{p}" for p, _ in self.sentinels]

    def master_port(self):
        """The master the sentinels name at the highest config-epoch; None
        if no sentinel answers. Right after a promotion the sentinels share
        the new epoch but the failover's leader still names the old master
        until it has reconfigured every replica (its `+failover-end`, ~1 s
        later), so between nodes named at that epoch the one that says ROLE
        master wins."""
        answers = []
        for port, _ in self.sentinels:
            try:
                m = pairs(resp(port, "SENTINEL", "MASTER", self.NAME, timeout=0.5))
                answers.append((int(m["config-epoch"]), int(m["port"])))
            except (OSError, RespError, KeyError, ValueError, ConnectionError):
                continue
        if not answers:
            return None
        top = max(e for e, _ in answers)
        named = sorted({p for e, p in answers if e == top})
        return next((p for p in named if len(named) > 1 and self.role(p) == "master"), named[0])

    def role(self, port):
        try:
            return resp(port, "ROLE", timeout=0.5)[0]
        except (OSError, RespError, ConnectionError, TypeError, IndexError):
            return None

    def replicas_of(self, master):
        return [p for p, proc in self.nodes.items() if p != master and proc.alive()]

    def _synced(self, master):
        """Every other live node replicates `master` with its link up and
        has its whole replication stream (offsets equal)."""
        m = info(master)
        if m.get("role") != "master" or int(m.get("connected_slaves", 0)) < len(self.replicas_of(master)):
            return False
        for port in self.replicas_of(master):
            r = info(port)
            if r.get("master_link_status") != "up" or r.get("master_sync_in_progress") != "0":
                return False
            if int(r.get("slave_repl_offset", -1)) < int(m.get("master_repl_offset", 0)):
                return False
        return True

    def healthy(self):
        """The sentinels agree on a running master that every other node
        replicates in sync, and no failover is in progress: the state a
        failover fault should start from."""
        master = self.master_port()
        if master is None or self.role(master) != "master":
            return False
        for port, _ in self.sentinels:
            m = pairs(resp(port, "SENTINEL", "MASTER", self.NAME, timeout=0.5))
            if int(m.get("port", 0)) != master or m.get("flags") != "master":
                return False
        return len(self.replicas_of(master)) == self.n_replicas and self._synced(master)

    def wait_healthy(self, timeout):
        # Polled gently: the sentinels are what is being timed.
        wait_for("a healthy sentinel set", timeout, self.healthy, poll=0.1)

    def kill_master(self):
        """SIGKILL the current master; returns (its port, monotonic ns of the kill)."""
        port = self.master_port()
        if port is None or port not in self.nodes:
            raise RuntimeError(f"no known master to kill ({port})")
        proc = self.nodes[port]
        proc.resume()
        proc.signal(signal.SIGKILL)
        t = time.monotonic_ns()
        proc.p.wait(timeout=10)
        return port, t

    def wait_new_master(self, old_port, timeout):
        """Waits until the sentinels name another node and it says ROLE
        master; returns its port."""
        found = {}

        def promoted():
            p = self.master_port()
            if p is not None and p != old_port and self.role(p) == "master":
                found["port"] = p
                return True
            return False
        wait_for(f"a master other than {old_port}", timeout, promoted, poll=0.05)
        return found["port"]

    def restart_node(self, port):
        """Starts a killed node again on the same port and directory (empty).

        It starts as a replica of the master the sentinels name: a node that
        came back as an (empty) master would be converted by the sentinels
        only after it has been up 8 s (their "no down for 4 × publish
        period" rule), leaving the set one replica short that long."""
        master = self.master_port()
        old = self.links.pop(port, None)
        if old:
            old.close()
        self._start_node(port, replicaof=master if master not in (None, port) else None)

    # ------------------------------------------------------------ replication links

    def route_links(self, timeout=10):
        """Re-routes every replica of the current master through a fresh
        link and waits until each is in sync through it."""
        master = self.master_port()
        for port in [p for p in self.links if p not in self.replicas_of(master)]:
            self.links.pop(port).close()
        for port in self.replicas_of(master):
            link = self._link(port, master)
            resp(port, "REPLICAOF", "127.0.0.1", link.port)
        wait_for("replicas in sync through their links", timeout,
                 lambda: self._synced(master) and all(
                     info(p).get("master_port") == str(self.links[p].port) for p in self.replicas_of(master)))
        return master

    def freeze_links(self):
        """Holds every replication byte (both ways, sockets open): the
        master goes on accepting writes its replicas never see."""
        for link in self.links.values():
            link.set("blackhole")

    def thaw_links(self):
        for link in self.links.values():
            link.set("pass")

    def reset_links(self):
        """RST every replication connection, dropping the bytes a frozen link
        held: what a dead master's unsent stream amounts to."""
        for link in self.links.values():
            link.reset_all()

    # ------------------------------------------------------------ data

    def cmd(self, *args, port=None):
        """One command on the current master (or `port`)."""
        return resp(port or self.master_port(), *args)

    def counter(self, key_name, port=None):
        """A lock key's token counter on the current master (or `port`);
        0 when absent."""
        v = resp(port or self.master_port(), "GET", counter_key(key_name))
        return int(v) if v is not None else 0

    def counters(self, keys, port=None):
        return {k: self.counter(k, port) for k in keys}

    def switches(self):
        """How many times the sentinels switched the master: `+switch-master`
        lines, most of any one sentinel's log. More than the nemesis caused
        means the sentinels failed over on their own (a new master slow to
        answer a sentinel within down-after right after a switch)."""
        most = 0
        for i in range(len(self.sentinels)):
            try:
                with open(os.path.join(self.dir, f"sentinel-{i}", "sentinel.log"), errors="replace") as f:
                    most = max(most, sum(1 for line in f if "+switch-master" in line))
            except OSError:
                pass
        return most

    def logs(self):
        out = []
        for port, p in self.nodes.items():
            try:
                with open(os.path.join(self.dir, f"node-{port}", "redis.log"), errors="replace") as f:
                    out.append(f"--- node {port}\n" + f.read()[-1500:])
            except OSError:
                pass
        return "\n".join(out)


# ---------------------------------------------------------------- Redis Cluster

# Flags under which a CLUSTER NODES line does not describe a usable node.
_FAILING = {"fail", "fail?", "handshake", "noaddr"}


def cluster_nodes(port, timeout=0.7):
    """One node's `CLUSTER NODES`, parsed: [{id, port, flags, master,
    epoch, link, slots: [(first, last)]}] (slots being migrated,
    `[…]`, left out)."""
    out = []
    for line in (resp(port, "CLUSTER", "NODES", timeout=timeout) or "").splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        addr = f[1].split("@")[0].split(",")[0]
        try:
            nport = int(addr.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            nport = 0
        slots = []
        for s in f[8:]:
            if s.startswith("["):
                continue
            a, _, b = s.partition("-")
            try:
                slots.append((int(a), int(b or a)))
            except ValueError:
                pass
        flags = set(f[2].split(","))
        out.append({"id": f[0], "port": nport, "flags": flags, "master": f[3], "epoch": int(f[6]),
                    "link": f[7], "slots": slots, "failing": bool(flags & _FAILING)})
    return out


def cluster_state_ok(port, timeout=0.7):
    text = resp(port, "CLUSTER", "INFO", timeout=timeout) or ""
    return "cluster_state:ok" in text


def slot_owner(view, slot):
    """The master serving `slot` in one node's view (a non-failing one if
    the view names two), or None."""
    owners = [n for n in view if "master" in n["flags"] and any(a <= slot <= b for a, b in n["slots"])]
    return next((n for n in owners if not n["failing"]), owners[0] if owners else None)


class RedisClusterSet:
    """A Redis Cluster of 3 masters + 3 replicas on free loopback ports in
    the run dir: the topology of `backend.redis.mode = "cluster"`, which the
    nemesis fails over shard by shard with kill -9.

    Nodes keep nothing on disk but their `nodes.conf` (`--save ''`, no AOF)
    and sync diskless, so a restarted node is empty; its `nodes.conf` makes
    it the same cluster node, and a former master comes back as a replica of
    the replica promoted in its place (the cluster's UPDATE). Node timeout
    1000 ms: a killed master's replica is promoted ~2 s after the kill. The
    cluster bus port of each node is an explicit free port (port + 10000 may
    be taken). The cluster announces the nodes' own addresses, so there is
    no fault proxy in front of it.
    """

    NODE_TIMEOUT_MS = 1000

    def __init__(self, run_dir, name="redis-cluster", masters=3, replicas_per_master=1, node_args=()):
        self.dir = os.path.join(run_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.n_masters, self.n_replicas = masters, replicas_per_master
        self.node_args = list(node_args)
        self.nodes = {}     # port -> Proc (dead or alive), in start order
        self.bus = {}       # port -> cluster bus port
        self._slots = {}    # lock key -> slot
        self.create_log = os.path.join(self.dir, "cluster-create.log")

    # ------------------------------------------------------------ start/stop

    def _node_dir(self, port):
        return os.path.join(self.dir, f"node-{port}")

    def _node_argv(self, port):
        d = self._node_dir(port)
        return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--cluster-enabled", "yes", "--cluster-config-file", os.path.join(d, "nodes.conf"),
                "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS), "--cluster-port", str(self.bus[port]),
                "--cluster-announce-ip", "127.0.0.1",
                "--dir", d, "--logfile", os.path.join(d, "redis.log")] + self.node_args

    def _spawn(self, port):
        p = self.nodes[port]
        p.start()
        end = time.time() + 10
        while time.time() < end:
            if not p.alive():
                raise RuntimeError(f"redis cluster node {port} exited:\n{self.logs()}")
            try:
                if resp(port, "PING", timeout=0.5) == "PONG":
                    return
            except (OSError, RespError, ConnectionError):
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis cluster node {port} does not answer PING after 10 s:\n{self.logs()}")

    def start(self, timeout=30):
        """Starts every node, joins them with `redis-cli --cluster create
        --cluster-replicas N`, and returns once every node says
        `cluster_state:ok` and every replica is attached (link up); raises
        with the log tails after `timeout`."""
        for _ in range(self.n_masters * (1 + self.n_replicas)):
            port = free_port()
            self.bus[port] = free_port()
            os.makedirs(self._node_dir(port), exist_ok=True)
            self.nodes[port] = Proc(f"redis-{port}", self._node_argv(port), dict(os.environ),
                                    os.path.join(self._node_dir(port), "stdout.log"))
            self._spawn(port)
        started = time.time()
        argv = (["redis-cli", "--cluster", "create"] + [f"127.0.0.1:{p}" for p in self.nodes] +
                ["--cluster-replicas", str(self.n_replicas), "--cluster-yes"])
        with open(self.create_log, "ab") as log:
            try:
                r = subprocess.run(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"redis-cli --cluster create hangs after {timeout} s:\n{self.logs()}")
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({r.returncode}):\n{self.logs()}")
        self.wait_healthy(max(5, timeout - (time.time() - started)))
        return self

    def stop(self):
        for p in self.nodes.values():
            p.kill()

    # ------------------------------------------------------------ topology

    def node_urls(self):
        return [f"redis://127.0.0.1:{p}" for p in self.nodes]

    def live(self):
        return [p for p, proc in self.nodes.items() if proc.alive()]

    def _view(self):
        """(port, view) of the first live node that answers CLUSTER NODES."""
        for port in self.live():
            try:
                return port, cluster_nodes(port)
            except (OSError, RespError, ConnectionError, ValueError):
                continue
        raise RuntimeError(f"no live cluster node answers CLUSTER NODES:\n{self.logs()}")

    def keyslot(self, key):
        """The slot of a lock key (of `fencer:{key}:lock`), by CLUSTER KEYSLOT."""
        if key not in self._slots:
            err = None
            for port in self.live():
                try:
                    self._slots[key] = int(resp(port, "CLUSTER", "KEYSLOT", lock_key(key)))
                    break
                except (OSError, RespError, ConnectionError, ValueError) as e:
                    err = e
            else:
                raise RuntimeError(f"CLUSTER KEYSLOT {lock_key(key)}: no live node answers ({err})")
        return self._slots[key]

    def master_for_slot(self, slot, timeout=5):
        """The port of the master serving `slot`, in the view of the first
        live node that names one (waits up to `timeout`)."""
        end = time.time() + timeout
        while True:
            for port in self.live():
                try:
                    owner = slot_owner(cluster_nodes(port), slot)
                except (OSError, RespError, ConnectionError, ValueError):
                    continue
                if owner:
                    return owner["port"]
            if time.time() > end:
                raise RuntimeError(f"no live node names a master for slot {slot}:\n{self.logs()}")
            time.sleep(0.1)

    def master_for_key(self, key):
        """The port of the master serving the slot of `fencer:{key}:lock`."""
        return self.master_for_slot(self.keyslot(key))

    def role(self, port):
        try:
            return resp(port, "ROLE", timeout=0.5)[0]
        except (OSError, RespError, ConnectionError, TypeError, IndexError):
            return None

    def replicas_of(self, master):
        """Live ports the cluster lists as replicas of `master`."""
        _, view = self._view()
        me = next((n for n in view if n["port"] == master), None)
        if me is None:
            return []
        live = set(self.live())
        return [n["port"] for n in view if n["master"] == me["id"] and n["port"] in live]

    def kill(self, port):
        """SIGKILL one node; returns the monotonic ns of the kill."""
        proc = self.nodes[port]
        proc.resume()
        proc.signal(signal.SIGKILL)
        t = time.monotonic_ns()
        proc.p.wait(timeout=10)
        return t

    def restart(self, port):
        """Starts a killed node again on the same ports and directory: the
        same cluster node (its nodes.conf), empty. A former master rejoins as
        a replica of its successor."""
        if self.nodes[port].alive():
            raise RuntimeError(f"redis cluster node {port} is running: kill it first")
        self._spawn(port)

    def wait_slot_master_change(self, slot, old_port, timeout):
        """Waits until a live node names a master other than `old_port` for
        `slot`, not failing, says `cluster_state:ok`, and that master says
        ROLE master; returns its port."""
        end = time.time() + timeout
        while True:
            for port in self.live():
                try:
                    owner = slot_owner(cluster_nodes(port), slot)
                    if (owner and owner["port"] != old_port and not owner["failing"]
                            and cluster_state_ok(port) and self.role(owner["port"]) == "master"):
                        return owner["port"]
                except (OSError, RespError, ConnectionError, ValueError):
                    continue
            if time.time() > end:
                raise RuntimeError(f"slot {slot} still on {old_port} (or cluster not ok) after {timeout} s:\n"
                                   f"{self.logs()}")
            time.sleep(0.05)

    def _healthy(self):
        """Every live node answers, says cluster_state:ok and sees every
        live node without a failure flag; all views agree on which master
        serves which slots; there are `masters` of them, each with a live
        replica; and each live replica's link is up and done syncing."""
        live = set(self.live())
        owners = None
        for port in live:
            if not cluster_state_ok(port):
                return False
            view = cluster_nodes(port)
            by_port = {n["port"]: n for n in view}
            if any(p not in by_port or by_port[p]["failing"] for p in live):
                return False
            serving = {n["id"]: n for n in view if "master" in n["flags"] and n["slots"] and not n["failing"]}
            if len(serving) != self.n_masters:
                return False
            mine = sorted((tuple(n["slots"]), n["port"]) for n in serving.values())
            if owners is None:
                owners = mine
            elif mine != owners:
                return False
            for mid in serving:
                if not any(n["master"] == mid and "slave" in n["flags"] and not n["failing"] and n["port"] in live
                           for n in view):
                    return False
            me = next((n for n in view if "myself" in n["flags"]), None)
            if me is None:
                return False
            if "slave" in me["flags"]:
                r = info(port)
                if r.get("master_link_status") != "up" or r.get("master_sync_in_progress") != "0":
                    return False
        return bool(live)

    def healthy(self, timeout=0):
        """Whether the cluster is healthy (`_healthy`), polled for up to
        `timeout` seconds (0: one look)."""
        end = time.time() + timeout
        while True:
            try:
                if self._healthy():
                    return True
            except (OSError, RespError, ConnectionError, ValueError, TypeError):
                pass
            if time.time() >= end:
                return False
            time.sleep(0.1)

    def wait_healthy(self, timeout):
        if not self.healthy(timeout):
            raise RuntimeError(f"redis cluster not healthy after {timeout:.1f} s:\n{self.logs()}")

    def heal(self, timeout=20):
        """Restarts any node that is down and waits until the cluster is
        healthy (raises with the log tails if it is not within `timeout`)."""
        for port, proc in self.nodes.items():
            if not proc.alive():
                self.restart(port)
        self.wait_healthy(timeout)

    # ------------------------------------------------------------ data

    def cmd_key(self, key, *args):
        """One command on the master serving lock key `key`."""
        return resp(self.master_for_key(key), *args)

    def counter(self, key, port=None):
        """A lock key's token counter on the master serving it, or on `port`
        (a replica answers after READONLY); 0 when absent."""
        readonly, v = resp_many(port or self.master_for_key(key), ("READONLY",), ("GET", counter_key(key)))
        if isinstance(v, RespError):
            raise v
        return int(v) if v is not None else 0

    def counters(self, keys, port=None):
        return {k: self.counter(k, port) for k in keys}

    def logs(self, lines=25):
        out = []
        for port, proc in self.nodes.items():
            state = "running" if proc.alive() else "dead"
            try:
                with open(os.path.join(self._node_dir(port), "redis.log"), errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError:
                tail = []
            out.append(f"--- node {port} ({state})\n" + "\n".join(tail))
        try:
            with open(self.create_log, errors="replace") as f:
                out.append("--- redis-cli --cluster create\n" + f.read()[-1500:])
        except OSError:
            pass
        for port in self.live():
            try:
                out.append(f"--- CLUSTER NODES from {port}\n" + resp(port, "CLUSTER", "NODES", timeout=0.5))
                break
            except (OSError, RespError, ConnectionError):
                continue
        return "\n".join(out)


class Postgres:
    """initdb into the run dir, postgres on a free port, as the `postgres`
    OS user when the harness runs as root."""

    def __init__(self, run_dir, name="pg", settings=(), faketime=None):
        self.dir = os.path.join(run_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        self.bin = self._bin_dir()
        self.uid = None
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            self.uid = (pw.pw_uid, pw.pw_gid)
            for p in (self.dir,):
                os.chown(p, *self.uid)
        os.chmod(self.dir, 0o700)
        self.data = os.path.join(self.dir, "data")
        self.settings = list(settings)
        self.faketime = faketime
        self._initdb()
        self.proc = None
        self.start()

    @staticmethod
    def _bin_dir():
        base = "/usr/lib/postgresql"
        versions = sorted((v for v in os.listdir(base) if os.path.exists(f"{base}/{v}/bin/initdb")),
                          key=lambda v: [int(x) for x in v.split(".")])
        return f"{base}/{versions[-1]}/bin"

    def _demote(self):
        if self.uid:
            gid, uid = self.uid[1], self.uid[0]

            def f():
                os.setgid(gid)
                os.setuid(uid)
            return f
        return None

    def _initdb(self):
        log = open(os.path.join(self.dir, "initdb.log"), "ab")
        subprocess.run([f"{self.bin}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres",
                        "--no-sync", "-E", "UTF8", "--locale=C"],
                       stdout=log, stderr=log, check=True, preexec_fn=self._demote(), cwd=self.dir)

    def start(self, env_extra=None):
        argv = [f"{self.bin}/postgres", "-D", self.data, "-p", str(self.port), "-k", self.dir,
                "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off",
                "-c", "max_connections=300"]
        for s in self.settings:
            argv += ["-c", s]
        env = dict(os.environ, HOME=self.dir)
        if self.faketime:
            # The server's wall clock offset (leases run on it); its
            # monotonic clock is left alone.
            env.update(faketime_env(self.faketime))
        env.update(env_extra or {})
        self.proc = Proc("postgres", argv, env, os.path.join(self.dir, "postgres.log"),
                         cwd=self.dir, preexec=self._demote())
        self.proc.start()
        wait_for("postgres", 30, self._ready)

    def _ready(self):
        if not self.proc.alive():
            raise RuntimeError("postgres exited: " + self.proc.logs()[-2000:])
        r = subprocess.run([f"{self.bin}/pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port),
                            "-U", "postgres", "-t", "1"], capture_output=True)
        return r.returncode == 0

    def url(self, port=None):
        return f"postgres://postgres@127.0.0.1:{port or self.port}/postgres"

    def psql(self, sql):
        r = subprocess.run([f"{self.bin}/psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                            "-d", "postgres", "-Atqc", sql], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        return r.stdout

    def family(self):
        pid = self.proc.pid
        return [pid] + children_of(pid)

    def pause(self):
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        for c in children_of(pid):
            try:
                os.kill(c, signal.SIGSTOP)
            except ProcessLookupError:
                pass

    def resume(self):
        for c in self.family():
            try:
                os.kill(c, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def crash_restart(self):
        """`pg_ctl -m immediate`-like: SIGKILL the family, then crash recovery."""
        pid = self.proc.pid
        fam = self.family()
        for c in fam:
            try:
                os.kill(c, signal.SIGCONT)
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.p.wait(timeout=10)
        end = time.time() + 20
        while any(proc_state(c) not in (None, "Z", "X") for c in fam) and time.time() < end:
            time.sleep(0.01)
        del pid
        self.start()

    def stop(self):
        if self.proc and self.proc.alive():
            self.resume()
            self.proc.signal(signal.SIGINT)
            try:
                self.proc.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                for c in self.family():
                    try:
                        os.kill(c, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


_MARIADB_TEMPLATE = None


def _mariadb_template():
    """One `mariadb-install-db` per suite process (≈ 5 s, mostly fsyncs),
    into a private temp dir removed at exit; every run copies it (a cleanly
    shut-down data dir, so a copy is a fresh server)."""
    global _MARIADB_TEMPLATE
    if _MARIADB_TEMPLATE is None:
        import atexit
        import tempfile
        for b in ("mariadbd", "mariadb-install-db", "mariadb"):
            need(b)
        base = tempfile.mkdtemp(prefix="fencer-faults-mariadb-")
        atexit.register(shutil.rmtree, base, True)
        os.makedirs(os.path.join(base, "tmp"))
        argv = ["mariadb-install-db", "--no-defaults", f"--datadir={base}/data", f"--tmpdir={base}/tmp",
                "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve",
                "--innodb-log-file-size=8M"] + (["--user=root"] if os.geteuid() == 0 else [])
        with open(os.path.join(base, "install.log"), "ab") as log:
            subprocess.run(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, check=True, timeout=120)
        _MARIADB_TEMPLATE = os.path.join(base, "data")
    return _MARIADB_TEMPLATE


class MariaDB:
    """A private MariaDB server for the `mysql` lock backend: its own data
    dir (a copy of a fresh `mariadb-install-db`), socket, tmpdir and free
    port; never the machine's own server. Durable as shipped:
    `innodb_flush_log_at_trx_commit` stays at its default 1, so every
    acknowledged commit survives `kill -9`. Killed, paused and restarted
    only through this handle (the PID it started).

    `clock_file`: mariadbd runs under libfaketime with its offset read from
    a file (`FAKETIME_TIMESTAMP_FILE`, re-read every second), so the
    nemesis can jump the server's wall clock — the clock leases run on —
    while it keeps running and its connections stay open (`set_offset`)."""

    def __init__(self, run_dir, name="mysql", clock_file=False):
        self.dir = os.path.join(run_dir, name)
        os.makedirs(os.path.join(self.dir, "tmp"), exist_ok=True)
        self.data = os.path.join(self.dir, "data")
        shutil.copytree(_mariadb_template(), self.data, symlinks=True)
        self.sock = os.path.join(self.dir, "sock")
        self.port = free_port()
        self.clock_file = os.path.join(self.dir, "faketime") if clock_file else None
        self.offset_s = 0.0
        if self.clock_file:
            self._write_offset(0)
        self.proc = None
        self.start()
        self.sql("CREATE DATABASE IF NOT EXISTS fencer", db=None)

    def _argv(self):
        return (["mariadbd", "--no-defaults", f"--datadir={self.data}", f"--port={self.port}",
                 f"--socket={self.sock}", f"--pid-file={self.dir}/pid", f"--tmpdir={self.dir}/tmp",
                 "--bind-address=127.0.0.1", "--skip-name-resolve", "--innodb-log-file-size=8M",
                 "--innodb-buffer-pool-size=16M", "--max-connections=500", "--skip-log-bin"]
                + (["--user=root"] if os.geteuid() == 0 else []))

    def _write_offset(self, seconds):
        tmp = self.clock_file + ".new"
        with open(tmp, "w") as f:
            f.write(f"{seconds:+.3f}\n")
        os.replace(tmp, self.clock_file)

    def start(self):
        env = dict(os.environ)
        if self.clock_file:
            if not os.path.exists(FAKETIME):
                raise RuntimeError(f"{FAKETIME} missing (Debian package faketime; tests/run.sh installs it)")
            env.update({"LD_PRELOAD": FAKETIME, "FAKETIME_TIMESTAMP_FILE": self.clock_file,
                        "FAKETIME_CACHE_DURATION": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
        self.proc = Proc("mariadbd", self._argv(), env, os.path.join(self.dir, "mariadbd.log"), cwd=self.dir)
        self.proc.start()
        wait_for("mariadbd", 60, self._ready, poll=0.05)

    def _ready(self):
        if not self.proc.alive():
            raise RuntimeError("mariadbd exited: " + self.proc.logs()[-2000:])
        r = subprocess.run(["mariadb", "--no-defaults", f"--socket={self.sock}", "-uroot", "-e", "SELECT 1"],
                           capture_output=True, timeout=5)
        return r.returncode == 0

    def url(self, port=None):
        return f"mysql://root@127.0.0.1:{port or self.port}/fencer"

    def sql(self, q, db="fencer", timeout=10):
        argv = ["mariadb", "--no-defaults", f"--socket={self.sock}", "-uroot", "-N", "-B", "-e", q]
        if db:
            argv.append(db)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip())
        return r.stdout

    def server_offset_s(self):
        """The server's wall clock minus ours, in seconds (±10 ms)."""
        t0 = time.time()
        out = self.sql("SELECT UNIX_TIMESTAMP(SYSDATE(6))", db=None)
        t1 = time.time()
        return float(out.strip()) - (t0 + t1) / 2

    def set_offset(self, seconds, timeout=5.0):
        """Jumps the running server's wall clock to `seconds` off the real
        one; returns the ms until the server's SYSDATE showed it (libfaketime
        re-reads the file within a second)."""
        t0 = time.monotonic()
        self._write_offset(seconds)
        self.offset_s = seconds
        while time.monotonic() - t0 < timeout:
            try:
                if abs(self.server_offset_s() - seconds) < 0.25:
                    return round((time.monotonic() - t0) * 1000)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"mariadbd's clock did not jump to {seconds:+.3f} s within {timeout} s")

    def alive(self):
        return self.proc is not None and self.proc.alive()

    def pause(self):
        self.proc.pause()

    def resume(self):
        self.proc.resume()

    def kill(self):
        """SIGKILL (no shutdown, no flush beyond what each commit already
        did); returns when the signal went out (monotonic ns)."""
        self.proc.resume()
        t = time.monotonic_ns()
        self.proc.signal(signal.SIGKILL)
        self.proc.p.wait(timeout=20)
        return t

    def restart(self):
        """Start again on the same data dir and port (InnoDB crash recovery
        after a kill)."""
        self.start()

    def stop(self):
        if self.proc and self.proc.alive():
            self.proc.kill()


class Fencer:
    """A fencer process (sidecar or gateway) of the binary under test."""

    def __init__(self, run_dir, name, role, binary, settings, mutants=(), faketime=None, ready=True,
                 config_text=None):
        self.name, self.role = name, role
        self.dir = os.path.join(run_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.api_port, self.proxy_port, self.admin_port = free_port(), free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FENCER")}
        env["FENCER_FAULTS_SECRET"] = SECRET
        env["FENCER__SIGNING__SECRET_ENV"] = "FENCER_FAULTS_SECRET"
        env["FENCER__LOG__FORMAT"] = "json"
        env["FENCER__LOG__LEVEL"] = "fencer=debug,warn"
        env["FENCER__ADMIN__LISTEN"] = f"127.0.0.1:{self.admin_port}"
        if role == "sidecar":
            env["FENCER__SIDECAR__LISTEN"] = f"127.0.0.1:{self.api_port}"
            env["FENCER__PROXY__LISTEN"] = f"127.0.0.1:{self.proxy_port}"
        else:
            env["FENCER__GATEWAY__LISTEN"] = f"127.0.0.1:{self.api_port}"
        for k, v in settings.items():
            env["FENCER__" + k.replace(".", "__").upper()] = str(v)
        if mutants:
            env["FENCER_MUTANT"] = ",".join(mutants)
        if config_text:
            # Settings the environment cannot spell (lists of tables, e.g.
            # gateway.routes): a config file of this process's own.
            path = os.path.join(self.dir, "fencer.toml")
            with open(path, "w") as f:
                f.write(config_text)
            env["FENCER_CONFIG"] = path
        if faketime:
            env.update(faketime_env(faketime))
        self.proc = Proc(name, [binary, role], env, os.path.join(self.dir, "fencer.log"))
        # ready=False: a sidecar that must start unready (on a Redis that
        # may evict, harness/eviction.py) is waited for until healthy only.
        self.start(ready)

    @property
    def api(self):
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def proxy(self):
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def admin(self):
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, ready=True):
        self.proc.start()
        wait_for(f"{self.name} healthz", 60, lambda: self._check_alive() and http_ok(self.admin + "/healthz"))
        if ready:
            wait_for(f"{self.name} readyz", 60, lambda: self._check_alive() and http_ok(self.admin + "/readyz"))

    def _check_alive(self):
        if not self.proc.alive():
            raise RuntimeError(f"{self.name} exited: " + self.proc.logs()[-3000:])
        return True

    def crash_restart(self):
        self.proc.kill()
        self.start()

    def metrics(self):
        try:
            with urllib.request.urlopen(self.admin + "/metrics", timeout=2) as r:
                return r.read().decode()
        except Exception:
            return ""

    def log_events(self):
        """The process's JSON log lines, parsed."""
        out = []
        for line in self.proc.logs().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out


def metric_sum(text, name, labels=None):
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric = line.split("{")[0].split(" ")[0]
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in line for k, v in labels.items()):
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            pass
    return total


def need(binary):
    if shutil.which(binary) is None and not os.path.exists(binary):
        raise SystemExit(f"{binary} is not installed (tests/run.sh installs it)")
