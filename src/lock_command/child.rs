//! CMD: started directly (no shell) with the lease in its environment and
//! the terminal's stdin/stdout/stderr, signalled and waited for.

use std::ffi::OsString;
use std::process::ExitStatus;
use std::time::Duration;

use super::exit::LockCmdError;
use super::stream::Lease;

/// The running CMD. Not killed on drop: every path that ends `fencer lock`
/// waits for it first (a CMD outliving the lease is what this prevents).
pub struct Cmd {
    child: tokio::process::Child,
    pid: i32,
    /// Set once `wait` has returned; signalling a reaped pid could hit an
    /// unrelated process that reused it.
    done: Option<ExitStatus>,
}

/// If `fencer lock` dies without a chance to stop CMD (SIGKILL, the OOM
/// killer), the sidecar sees its connection close and releases the key at
/// once; CMD then gets SIGTERM from the kernel (Linux's parent-death
/// signal) instead of working on without the lock.
///
/// The signal follows the *thread* that spawned CMD: a tokio worker, which
/// lives as long as the process.
#[cfg(target_os = "linux")]
fn stop_with_parent(cmd: &mut tokio::process::Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs
    // between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Died between fork and prctl: no signal will come.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("fencer lock exited"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn stop_with_parent(_cmd: &mut tokio::process::Command) {}

/// The variables CMD finds the lease in.
pub fn lease_env(lease: &Lease) -> [(&'static str, String); 4] {
    [
        ("FENCER_KEY", lease.key.clone()),
        ("FENCER_LEASE", lease.lease_id.clone()),
        ("FENCER_TOKEN", lease.token.to_string()),
        ("FENCER_FENCING_TOKEN", lease.fencing_token.clone()),
    ]
}

impl Cmd {
    pub fn spawn(command: &[OsString], lease: &Lease) -> Result<Cmd, LockCmdError> {
        let (program, args) = command.split_first().expect("clap requires CMD");
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args).envs(lease_env(lease)).kill_on_drop(false);
        stop_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|source| LockCmdError::Spawn {
            cmd: program.to_string_lossy().into_owned(),
            source,
        })?;
        let pid = child.id().expect("a just-spawned child has a pid") as i32;
        Ok(Cmd {
            child,
            pid,
            done: None,
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends `sig` to CMD unless it has been reaped already.
    pub fn signal(&self, sig: i32) {
        if self.done.is_none() {
            // SAFETY: kill(2) with a pid we spawned and have not reaped.
            unsafe {
                libc::kill(self.pid, sig);
            }
        }
    }

    /// Waits for CMD to exit. Cancel-safe (tokio's `Child::wait`).
    pub async fn wait(&mut self) -> ExitStatus {
        if let Some(status) = self.done {
            return status;
        }
        let status = match self.child.wait().await {
            Ok(status) => status,
            // Only if the child was reaped behind tokio's back: report it
            // as killed rather than hang.
            Err(_) => std::os::unix::process::ExitStatusExt::from_raw(libc::SIGKILL),
        };
        self.done = Some(status);
        status
    }

    /// SIGTERM, then SIGKILL if CMD is still running after `grace`.
    pub async fn stop(&mut self, grace: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        if let Ok(status) = tokio::time::timeout(grace, self.wait()).await {
            return status;
        }
        tracing::debug!(pid = self.pid, "grace period over: SIGKILL");
        self.signal(libc::SIGKILL);
        self.wait().await
    }
}
