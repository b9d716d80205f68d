"""ZooKeeper servers a fault-suite run starts and owns: one standalone
server (n=1) or an ensemble of n members (default 3), on free loopback
ports in the run dir, with the Debian `zookeeper` package's jars.

Why our own: the ZooKeeper backend is only as safe as its behaviour across
leader elections and session expiries, so the nemesis must be able to kill
(SIGKILL), pause (SIGSTOP) and restart single members and time what follows.
Every member is a `Proc` this class spawned, signalled only through that
handle (never by name), and `stop()` kills them all.

Timing: tickTime 200 ms, syncLimit 5 (a follower or leader that hears
nothing for 1 s gives up on its peer), initLimit 20 (4 s to sync after an
election), minSessionTimeout 1000 ms. Leader election notifications back
off to at most 1 s (`zookeeper.fastleader.maxNotificationInterval`; the
default 60 s makes a member restarted after a long outage rejoin slowly),
and an election connection to a peer gives up after 1 s
(`zookeeper.cnxTimeout`, default 5 s: a paused peer otherwise stalls an
election that long). Readiness is asked with the `srvr` four-letter word:
a member that serves says `Mode: standalone|leader|follower`; one that is
electing or syncing says it is "not currently serving requests".
"""
import os
import shutil
import signal
import socket
import time

from .procs import Proc, free_port, wait_for

JAVA = "/usr/bin/java"
JARS = ["zookeeper", "zookeeper-jute", "slf4j-api", "slf4j-simple", "netty-handler", "netty-common",
        "netty-buffer", "netty-transport", "netty-codec", "netty-resolver", "netty-transport-native-epoll",
        "netty-transport-native-unix-common", "metrics-core"]
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
TICK_MS = 200
START_TIMEOUT = 30
PROBE_TIMEOUT = 0.7


def classpath():
    """The installed jars of JARS (those that exist), ':'-joined."""
    jars = [f"/usr/share/java/{j}.jar" for j in JARS]
    if not os.path.exists(jars[0]):
        raise SystemExit(f"{jars[0]} is not installed (Debian package zookeeper; tests/run.sh installs it)")
    return ":".join(j for j in jars if os.path.exists(j))


def four_letter(port, word="srvr", timeout=PROBE_TIMEOUT):
    """A four-letter word's whole answer (the server closes the connection
    after it), or None if the port does not answer within `timeout`."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError:
        return None
    try:
        s.sendall(word.encode())
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return None
    finally:
        s.close()


def parse_srvr(text):
    """`srvr`'s answer as (mode, zxid): mode 'standalone', 'leader' or
    'follower' (None while not serving), zxid an int (None if absent)."""
    mode = zxid = None
    for line in (text or "").splitlines():
        k, _, v = line.partition(":")
        if k == "Mode":
            mode = v.strip()
        elif k == "Zxid":
            try:
                zxid = int(v.strip(), 16)
            except ValueError:
                pass
    return mode, zxid


class _Exited(Exception):
    """A member that should run has exited."""


class ZooKeeperEnsemble:
    """n ZooKeeper members (n=1: a standalone server), started by the
    constructor; returns once every member serves (one leader, n-1
    followers) or raises with the log tails after 30 s.

    Member i has client port `ports[i]`, server id i+1 and directory
    `<run_dir>/<name>/member-<i>` (zoo.cfg, data/, zookeeper.log); a restart
    keeps its ports and data. If a member cannot bind a port at first start
    (another process took it after `free_port` checked it), the whole
    ensemble starts again on fresh ports.
    """

    def __init__(self, run_dir, n=3, name="zk"):
        self.dir = os.path.join(run_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.n, self.name = n, name
        self.cp = classpath()
        self.procs = []
        self.paused = set()
        for attempt in range(3):
            self.ports = [free_port() for _ in range(n)]
            # (quorum port, election port) of each member; unused when n=1.
            self.peer_ports = [(free_port(), free_port()) for _ in range(n)] if n > 1 else []
            self.procs = [self._proc(i) for i in range(n)]
            for p in self.procs:
                p.start()
            try:
                self.wait_healthy(START_TIMEOUT)
                return
            except RuntimeError:
                logs = self.logs()
                self.stop()
                if "Address already in use" not in logs or attempt == 2:
                    raise
                for i in range(n):
                    shutil.rmtree(self._member_dir(i), ignore_errors=True)

    # ------------------------------------------------------------ processes

    def _member_dir(self, i):
        return os.path.join(self.dir, f"member-{i}")

    def _proc(self, i):
        d = self._member_dir(i)
        data = os.path.join(d, "data")
        os.makedirs(data, exist_ok=True)
        cfg = [f"tickTime={TICK_MS}", "initLimit=20", "syncLimit=5", f"dataDir={data}",
               f"clientPort={self.ports[i]}", "clientPortAddress=127.0.0.1", "admin.enableServer=false",
               "minSessionTimeout=1000", "maxSessionTimeout=60000", "reconfigEnabled=false",
               # Every client connects from 127.0.0.1; the default cap is 60 per address.
               "maxClientCnxns=0", "4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,conf",
               # No fsync per transaction: a kill -9 keeps the log in the
               # page cache; only an OS crash (never made here) would lose it.
               "forceSync=no"]
        for j, (quorum, election) in enumerate(self.peer_ports):
            cfg.append(f"server.{j + 1}=127.0.0.1:{quorum}:{election}")
        with open(os.path.join(d, "zoo.cfg"), "w") as f:
            f.write("\n".join(cfg) + "\n")
        if self.peer_ports:
            with open(os.path.join(data, "myid"), "w") as f:
                f.write(f"{i + 1}\n")
        argv = [JAVA, "-Xmx128m", "-Xss512k", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:-UsePerfData",
                "-Djava.net.preferIPv4Stack=true", "-Dzookeeper.admin.enableServer=false",
                "-Dzookeeper.fastleader.maxNotificationInterval=1000", "-Dzookeeper.cnxTimeout=1000",
                "-Dorg.slf4j.simpleLogger.showDateTime=true",
                "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
                "-cp", self.cp, MAIN, os.path.join(d, "zoo.cfg")]
        return Proc(f"{self.name}-{i}", argv, dict(os.environ), os.path.join(d, "zookeeper.log"), cwd=d)

    def pid(self, i):
        return self.procs[i].pid

    def alive(self, i):
        return self.procs[i].alive()

    def answering(self, i):
        """Alive and not paused: worth asking."""
        return self.procs[i].alive() and i not in self.paused

    def kill(self, i):
        """SIGKILL member i (a paused one too); returns the monotonic ns of
        the kill."""
        p = self.procs[i]
        p.resume()
        p.signal(signal.SIGKILL)
        t = time.monotonic_ns()
        if p.p is not None:
            try:
                p.p.wait(timeout=10)
            except Exception:
                pass
        self.paused.discard(i)
        return t

    def kill_leader(self):
        """SIGKILL the current leader; returns (its index, monotonic ns of
        the kill)."""
        i = self.leader()
        return i, self.kill(i)

    def restart(self, i, timeout=START_TIMEOUT):
        """Starts member i again (killing it first if it runs) on the same
        ports and data directory. Returns once it serves — or, if the
        members alive and unpaused (it included) are no quorum, once its
        client port answers at all (it cannot serve until a quorum is back)."""
        if self.procs[i].alive():
            self.kill(i)
        self.procs[i].start()
        quorum = sum(1 for j in range(self.n) if self.answering(j)) > self.n // 2

        def up():
            self._check_alive(i)
            text = four_letter(self.ports[i])
            return text is not None and (not quorum or parse_srvr(text)[0] is not None)
        self._wait(f"{self.name}-{i} to {'serve' if quorum else 'answer'}", timeout, up)

    def pause(self, i):
        """SIGSTOP member i: it keeps its sockets and sessions but answers
        nothing, like a frozen machine."""
        if not self.procs[i].alive():
            raise RuntimeError(f"{self.name}-{i} is not running")
        self.procs[i].pause()
        self.paused.add(i)

    def resume(self, i):
        self.procs[i].resume()
        self.paused.discard(i)

    def resume_all(self):
        for i in range(self.n):
            self.resume(i)

    def stop(self):
        for i in range(len(self.procs)):
            self.kill(i)

    # ------------------------------------------------------------ state

    def connect_string(self):
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def srvr(self, i):
        """Member i's `srvr` answer; None if it is dead, paused or silent."""
        return four_letter(self.ports[i]) if self.answering(i) else None

    def mode(self, i):
        """'standalone', 'leader' or 'follower'; None if member i does not serve."""
        return parse_srvr(self.srvr(i))[0]

    def modes(self):
        return [self.mode(i) for i in range(self.n)]

    def try_zxid(self, i):
        return parse_srvr(self.srvr(i))[1]

    def zxid(self, i, timeout=10):
        """Member i's last zxid (epoch in the high 32 bits), waiting up to
        `timeout` for it to serve."""
        found = {}

        def look():
            found["z"] = self.try_zxid(i)
            return found["z"] is not None
        self._wait(f"{self.name}-{i} to report its zxid", timeout, look)
        return found["z"]

    def try_leader(self):
        """The index of the member that leads (a standalone server leads
        itself), or None. A leader paused and resumed says "leader" until it
        notices it lost its followers (≤ syncLimit); of two, the one with
        the higher epoch wins."""
        leaders = []
        for i in range(self.n):
            mode, zxid = parse_srvr(self.srvr(i))
            if mode in ("leader", "standalone"):
                leaders.append(((zxid or 0) >> 32, i))
        return max(leaders)[1] if leaders else None

    def leader(self, timeout=START_TIMEOUT):
        """The leader's index, waiting up to `timeout` for there to be one."""
        found = {}

        def look():
            found["i"] = self.try_leader()
            return found["i"] is not None
        self._wait("a leader", timeout, look)
        return found["i"]

    def wait_new_leader(self, old, timeout=START_TIMEOUT):
        """Waits until a member other than `old` leads; returns its index."""
        found = {}

        def look():
            found["i"] = self.try_leader()
            return found["i"] not in (None, old)
        self._wait(f"a leader other than {self.name}-{old}", timeout, look, poll=0.01)
        return found["i"]

    def healthy(self):
        """Every member runs unpaused and serves: one leader and n-1
        followers (n=1: standalone)."""
        if not all(self.answering(i) for i in range(self.n)):
            return False
        modes = self.modes()
        if self.n == 1:
            return modes == ["standalone"]
        return modes.count("leader") == 1 and modes.count("follower") == self.n - 1

    def wait_healthy(self, timeout=START_TIMEOUT):
        """Waits until `healthy()`; raises at once if a member is not
        running (a member killed must be restarted first)."""
        def check():
            for i in range(self.n):
                self._check_alive(i)
            return self.healthy()
        self._wait(f"{self.name} healthy", timeout, check, poll=0.05)

    def _check_alive(self, i):
        if not self.procs[i].alive():
            raise _Exited(f"{self.name}-{i} is not running (exit status {self.procs[i].p.returncode})")

    def _wait(self, what, timeout, check, poll=0.02):
        """`wait_for`, raising with the modes and log tails; a member that is
        not running (`_Exited` from `check`) ends the wait at once."""
        fatal = []

        def step():
            try:
                return check()
            except _Exited as e:
                fatal.append(e)
                return True
        try:
            wait_for(what, timeout, step, poll=poll)
        except RuntimeError:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what} (modes {self.modes()}):\n"
                               f"{self.logs()}") from None
        if fatal:
            raise RuntimeError(f"waiting for {what}: {fatal[0]}:\n{self.logs()}")

    def logs(self, lines=25):
        out = []
        for i, p in enumerate(self.procs):
            state = "paused" if i in self.paused else "running" if p.alive() else "dead"
            tail = p.logs().splitlines()[-lines:]
            out.append(f"--- {self.name}-{i} client port {self.ports[i]} pid {p.pid} ({state})\n" + "\n".join(tail))
        return "\n".join(out)
