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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SECRET = "fault-suite-secret-0123456789-abcdefghijklmnop"
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"

_used_ports = set()


def free_port():
    """A free port below the kernel's ephemeral range (outgoing connections
    never take it between our check and the bind)."""
    for _ in range(1000):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        p = 10000 + (p % 20000)
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


def wait_for(what, timeout, check):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.02)
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
    def __init__(self, run_dir, name="redis", aof=True):
        self.dir = os.path.join(run_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log")]
        argv += ["--appendonly", "yes", "--appendfsync", "always"] if aof else ["--appendonly", "no"]
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
            env.update(LD_PRELOAD=FAKETIME, FAKETIME=self.faketime, FAKETIME_DONT_FAKE_MONOTONIC="1",
                       FAKETIME_NO_CACHE="1")
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


class Fencer:
    """A fencer process (sidecar or gateway) of the binary under test."""

    def __init__(self, run_dir, name, role, binary, settings, mutants=(), faketime=None):
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
        if faketime:
            env["LD_PRELOAD"] = FAKETIME
            env["FAKETIME"] = faketime
            env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
            env["FAKETIME_NO_CACHE"] = "1"
        self.proc = Proc(name, [binary, role], env, os.path.join(self.dir, "fencer.log"))
        self.start()

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
