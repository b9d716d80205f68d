//! The one skeleton every test-server launcher is built on: a child
//! process with its log file, a bounded wait until it is ready, and the
//! faults a test applies to it (kill -9, stop, pause, resume, restart).
//!
//! Why one skeleton: PostgreSQL, MariaDB, ZooKeeper and the Redis launchers
//! used to carry five copies of the same lifecycle, each with its own small
//! differences (one forgot to reap, one did not resume a paused server
//! before stopping it). Here the lifecycle is written once; a launcher only
//! says *how to start* (a [`Command`] it builds from its own state, so a
//! restart reuses the same port and directory) and *when it is ready* (a
//! probe closure).
//!
//! A server that is a family of processes (PostgreSQL's postmaster and its
//! backends) is marked with [`ServerProcess::family`]: pause, resume and
//! kill then reach every child too, the way a frozen or crashed machine
//! would, instead of leaving backends answering on open connections.

use std::cell::Cell;
use std::fmt;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Why a server did not come up.
#[derive(Debug)]
pub enum StartError {
    /// The process exited while we waited for it to be ready.
    Exited {
        what: String,
        status: ExitStatus,
        log: String,
    },
    /// It ran but was not ready within the deadline (it has been killed).
    NotReady {
        what: String,
        timeout: Duration,
        log: String,
    },
}

impl StartError {
    /// The port was taken between our check and the server's bind: the
    /// caller should try again on another port.
    pub fn port_taken(&self) -> bool {
        match self {
            StartError::Exited { log, .. } | StartError::NotReady { log, .. } => {
                log.contains("Address already in use")
            }
        }
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Exited { what, status, log } => {
                write!(f, "{what} exited with {status}:\n{log}")
            }
            StartError::NotReady { what, timeout, log } => {
                write!(f, "{what} not ready after {timeout:?}:\n{log}")
            }
        }
    }
}

impl std::error::Error for StartError {}

/// A server the test did not get to stop politely in time.
#[derive(Debug)]
pub struct StopTimeout {
    pub what: String,
    pub timeout: Duration,
}

impl fmt::Display for StopTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} did not exit within {:?} (killed)",
            self.what, self.timeout
        )
    }
}

/// One server process: spawned with stdout and stderr appended to its log
/// file, signalled only through the PID we spawned, killed and reaped on
/// drop (even after a panic). The launcher owns the directory and builds
/// the command; this owns the process.
pub struct ServerProcess {
    what: String,
    log: PathBuf,
    child: Option<Child>,
    paused: AtomicBool,
    family: bool,
    /// Outlives its handle: see [`detached`].
    detached: bool,
}

impl ServerProcess {
    /// `what` names the server in panics and log sections; `log` is the
    /// file its stdout and stderr are appended to (across restarts).
    pub fn new(what: impl Into<String>, log: impl Into<PathBuf>) -> ServerProcess {
        let log = log.into();
        let detached = DETACH.with(Cell::get);
        if detached {
            if let Some(dir) = log.parent() {
                remove_at_exit(dir);
            }
        }
        ServerProcess {
            what: what.into(),
            log,
            child: None,
            paused: AtomicBool::new(false),
            family: false,
            detached,
        }
    }

    /// Pause, resume and kill also signal the server's child processes.
    pub fn family(mut self) -> ServerProcess {
        self.family = true;
        self
    }

    pub fn what(&self) -> &str {
        &self.what
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Spawns `cmd` (stdin null, stdout and stderr appended to the log);
    /// does not wait. Panics if it is already running: kill it first.
    pub fn spawn(&mut self, mut cmd: Command) {
        assert!(self.child.is_none(), "{} is already running", self.what);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("{}: open {}: {e}", self.what, self.log.display()));
        if self.detached {
            // Its own group: the exit watcher kills the whole group (a
            // postmaster's backends too), and a Ctrl-C of the test run
            // does not reach it before the watcher has the list.
            cmd.process_group(0);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {} ({:?}): {e}", self.what, cmd.get_program()));
        if self.detached {
            exit_watcher().line(&format!("group {}", child.id()));
        }
        self.child = Some(child);
        self.paused.store(false, Ordering::SeqCst);
    }

    /// [`spawn`](Self::spawn), then polls `ready` every `poll` until it is
    /// true. If the process exits first, or `timeout` passes (then it is
    /// killed), returns why with the log tail.
    pub fn start(
        &mut self,
        cmd: Command,
        timeout: Duration,
        poll: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), StartError> {
        self.spawn(cmd);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(StartError::Exited {
                    what: self.what.clone(),
                    status,
                    log: self.log_tail(30),
                });
            }
            if ready() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                self.kill();
                return Err(StartError::NotReady {
                    what: self.what.clone(),
                    timeout,
                    log: self.log_tail(30),
                });
            }
            std::thread::sleep(poll);
        }
    }

    /// Spawned and not yet killed or stopped by us.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Spawned and not exited (an exited child is a zombie until reaped).
    pub fn alive(&self) -> bool {
        match &self.child {
            None => false,
            Some(c) => alive(c.id()),
        }
    }

    /// Alive and not paused: worth asking.
    pub fn answering(&self) -> bool {
        self.alive() && !self.paused()
    }

    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .unwrap_or_else(|| panic!("{} is not running", self.what))
            .id()
    }

    /// SIGKILL (a paused server too) and reap: a crash. With
    /// [`family`](Self::family), the parent is frozen first so it cannot
    /// fork while its children are collected and killed, and we wait until
    /// those children (which init reaps, not us) are gone, so a restart
    /// does not find their shared memory.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id();
            if self.family {
                signal(pid, libc::SIGSTOP);
                wait_stopped(pid);
                let family = children_of(pid);
                for &c in &family {
                    signal(c, libc::SIGKILL);
                }
                let _ = child.kill();
                let _ = child.wait();
                let start = Instant::now();
                while family.iter().any(|&c| alive(c)) && start.elapsed() < Duration::from_secs(30)
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
            } else {
                signal(pid, libc::SIGCONT);
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        self.paused.store(false, Ordering::SeqCst);
    }

    /// A polite shutdown: resume (a paused server cannot act on `sig`), send
    /// `sig` and wait for the exit. After `timeout` the server is killed and
    /// the caller learns it did not stop by itself.
    pub fn stop(&mut self, sig: i32, timeout: Duration) -> Result<(), StopTimeout> {
        let Some(child) = &self.child else {
            return Ok(());
        };
        let pid = child.id();
        self.resume();
        signal(pid, sig);
        let start = Instant::now();
        loop {
            if self.child.as_mut().unwrap().try_wait().unwrap().is_some() {
                self.child = None;
                return Ok(());
            }
            if start.elapsed() > timeout {
                self.kill();
                return Err(StopTimeout {
                    what: self.what.clone(),
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGSTOP: sockets stay open, nothing answers (a frozen machine).
    pub fn pause(&self) {
        let pid = self.pid();
        signal(pid, libc::SIGSTOP);
        // Returns once it is stopped: a request sent right after must meet
        // a frozen server (a busy machine may still run it for a moment
        // after the signal: an etcd member then answered a read sent after
        // `pause`, and the client kept preferring it).
        wait_stopped(pid);
        if self.family {
            for c in children_of(pid) {
                signal(c, libc::SIGSTOP);
            }
        }
        self.paused.store(true, Ordering::SeqCst);
    }

    /// SIGCONT (no-op when not running).
    pub fn resume(&self) {
        if let Some(child) = &self.child {
            let pid = child.id();
            if self.family {
                for c in children_of(pid) {
                    signal(c, libc::SIGCONT);
                }
            }
            signal(pid, libc::SIGCONT);
        }
        self.paused.store(false, Ordering::SeqCst);
    }

    /// The whole log (every restart).
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.logs(), lines)
    }

    /// "dead", "paused" or "running", for log sections.
    pub fn state(&self) -> &'static str {
        match (self.alive(), self.paused()) {
            (false, _) => "dead",
            (true, true) => "paused",
            (true, false) => "running",
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

// ------------------------------------------------------- detached servers

thread_local! {
    static DETACH: Cell<bool> = const { Cell::new(false) };
}

/// Runs `start` with every [`ServerProcess`] it creates *detached*: in its
/// own process group, killed (with its directory removed) by a watcher
/// process once this test binary has exited, not when its handle drops.
///
/// Why: a server shared by the tests of one binary lives in a `static`,
/// and statics are never dropped. `PR_SET_PDEATHSIG` does not help
/// either: it fires when the *spawning thread* exits, and libtest runs
/// every test on its own thread, so the server would die with the first
/// test that happened to start it.
pub fn detached<T>(start: impl FnOnce() -> T) -> T {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            DETACH.with(|d| d.set(false));
        }
    }
    DETACH.with(|d| d.set(true));
    let _reset = Reset;
    start()
}

/// Removes `dir` (recursively) once this test binary has exited.
pub fn remove_at_exit(dir: &Path) {
    exit_watcher().line(&format!("dir {}", dir.display()));
}

/// One `sh` per test binary that waits for the binary's PID to be gone,
/// then SIGKILLs every registered process group and removes every
/// registered directory. The list is a file, appended as servers start, so
/// the watcher reads what was registered up to the very end.
struct ExitWatcher {
    list: Mutex<std::fs::File>,
}

impl ExitWatcher {
    fn line(&self, line: &str) {
        let mut f = self.list.lock().unwrap_or_else(|e| e.into_inner());
        writeln!(f, "{line}").expect("write the exit watcher's list");
        f.flush().unwrap();
    }
}

const WATCHER_SCRIPT: &str = r#"
while kill -0 "$1" 2>/dev/null; do sleep 0.2; done
while read -r kind arg; do
  # A negative PID is a process group (dash's kill takes no "--").
  if [ "$kind" = group ]; then kill -CONT "-$arg"; kill -KILL "-$arg"; fi 2>/dev/null
done < "$2"
sleep 0.3
while read -r kind arg; do
  [ "$kind" = dir ] && rm -rf -- "$arg"
done < "$2"
rm -f -- "$2"
"#;

// Not waited for: it outlives this process and init reaps it.
#[allow(clippy::zombie_processes)]
fn exit_watcher() -> &'static ExitWatcher {
    static WATCHER: OnceLock<ExitWatcher> = OnceLock::new();
    WATCHER.get_or_init(|| {
        let me = std::process::id();
        let path = std::env::temp_dir().join(format!("fencer-shared-servers-{me}.list"));
        let list = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .expect("create the exit watcher's list");
        Command::new("sh")
            .args(["-c", WATCHER_SCRIPT, "fencer-exit-watcher"])
            .arg(me.to_string())
            .arg(&path)
            // Not in our group: a Ctrl-C must not kill it before it cleans up.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the exit watcher (sh)");
        ExitWatcher {
            list: Mutex::new(list),
        }
    })
}

/// The last `lines` lines of `text`, each ending in a newline.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for l in &all[all.len().saturating_sub(lines)..] {
        out.push_str(l);
        out.push('\n');
    }
    out
}

pub fn signal(pid: u32, sig: i32) {
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// (state, ppid) from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ppid ..." — comm may contain spaces and parens.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Exists and is neither a zombie nor dead.
pub fn alive(pid: u32) -> bool {
    matches!(proc_stat(pid), Some((state, _)) if state != 'Z' && state != 'X')
}

fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| matches!(proc_stat(pid), Some((_, ppid)) if ppid == parent))
        .collect()
}

/// Waits (briefly) until `pid` is in the stopped state, so that it can no
/// longer fork.
fn wait_stopped(pid: u32) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        match proc_stat(pid) {
            Some(('T', _)) | None => return,
            Some((s, _)) if s == 'Z' || s == 'X' => return,
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}
