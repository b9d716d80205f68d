//! Printing for the subcommands (`check-config`, `demo`, `bench`, `top`,
//! `dev`'s banner): never panics, never kills the process.
//!
//! Why: `println!` panics when stdout is a pipe whose reader has gone —
//! `fencer check-config | head -1` exited 101 with a panic message. Here a
//! write that fails (EPIPE, a closed descriptor, a full disk) means "stop
//! printing": it and every later [`stdout`] call return `false`, and a
//! caller with more to do (`top`'s refresh loop) stops. SIGPIPE stays
//! ignored (Rust's default), so a server whose stdout goes away is not
//! killed by it. Messages for the operator ([`stderr`]) go through the log
//! queue once logging runs, so they never block and keep their place
//! after the log lines before them.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);

/// Writes `args` to stdout and flushes. `false` once stdout cannot be
/// written: the caller should stop producing output.
pub fn stdout(args: fmt::Arguments<'_>) -> bool {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return false;
    }
    let mut out = std::io::stdout().lock();
    let ok = out.write_fmt(args).and_then(|()| out.flush()).is_ok();
    if !ok {
        STDOUT_GONE.store(true, Ordering::Relaxed);
    }
    ok
}

/// Whether a write to stdout has failed (its reader has gone).
pub fn stdout_gone() -> bool {
    STDOUT_GONE.load(Ordering::Relaxed)
}

/// A message for the operator on stderr; errors are ignored.
pub fn stderr(args: fmt::Arguments<'_>) {
    crate::telemetry::queue::push(fmt::format(args).as_bytes());
}

/// `println!` that never panics; evaluates to `false` once stdout is gone.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::out::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` that never panics; evaluates to `false` once stdout is gone.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::stdout(format_args!($($arg)*))
    };
}

/// `eprintln!` that never panics nor blocks (see [`stderr`]).
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::out::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}
