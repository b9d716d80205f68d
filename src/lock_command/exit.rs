//! Why `fencer lock` stops, and the exit code each reason gets.
//!
//! The codes follow sysexits(3) where one fits, and the shell's own
//! conventions for a command that cannot be run, so a cron job or a script
//! can tell "someone else has it" (75, try later) from "the sidecar is
//! down" (69) from "the lease was lost under the command" (70).

use std::process::ExitStatus;

/// EX_USAGE: bad flags or arguments.
pub const USAGE: u8 = 64;
/// EX_UNAVAILABLE: the sidecar could not be reached or answered unexpectedly.
pub const UNAVAILABLE: u8 = 69;
/// EX_SOFTWARE: the lease was lost while CMD ran; CMD was stopped.
pub const LEASE_LOST: u8 = 70;
/// EX_TEMPFAIL: the key is held; not acquired within `--wait`.
pub const KEY_HELD: u8 = 75;
/// CMD exists but cannot be executed (as shells report it).
pub const NOT_EXECUTABLE: u8 = 126;
/// CMD was not found (as shells report it).
pub const NOT_FOUND: u8 = 127;

/// A failure before or around CMD, each with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum LockCmdError {
    #[error("cannot reach the sidecar at {api}: {reason}")]
    Unreachable { api: String, reason: String },
    #[error("{key} is held; not acquired within {wait}")]
    Held { key: String, wait: String },
    /// The sidecar refused the request; 400 is the caller's mistake (a bad
    /// key), anything else the sidecar's state.
    #[error("the sidecar answered {status} {code}: {message}")]
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    #[error("unexpected answer from the sidecar: {0}")]
    Protocol(String),
    #[error("cannot run {cmd}: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
}

impl LockCmdError {
    pub fn exit_code(&self) -> u8 {
        match self {
            LockCmdError::Unreachable { .. } | LockCmdError::Protocol(_) => UNAVAILABLE,
            LockCmdError::Held { .. } => KEY_HELD,
            LockCmdError::Refused { status: 400, .. } => USAGE,
            LockCmdError::Refused { .. } => UNAVAILABLE,
            LockCmdError::Spawn { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => NOT_FOUND,
                _ => NOT_EXECUTABLE,
            },
        }
    }
}

/// CMD's status as a shell reports it: its exit code, or 128 + the signal
/// that ended it.
pub fn status_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        // Neither: stopped/continued statuses are not final; wait() does
        // not return them.
        (None, None) => UNAVAILABLE,
    }
}
