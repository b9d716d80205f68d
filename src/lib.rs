//! fencer: a distributed-lock sidecar with fencing tokens, and the storage
//! gateway that enforces them.
//!
//! - [`lock`] — where locks live (Redis, memory), behind one trait;
//! - [`sidecar`] — the application-facing lock API, wait queues, lease deadlines;
//! - [`token`] — signed fencing tokens;
//! - [`admin`], [`metrics`], [`telemetry`] — health, Prometheus, logs;
//! - [`out`] — printing that a closed stdout cannot turn into a panic;
//! - [`settings`] — configuration (defaults, TOML file, environment).

// Printing goes through [`out`] (`outln!`, `errln!`): `println!` panics
// when stdout's reader has gone.
#![deny(clippy::print_stdout, clippy::print_stderr)]

/// `0.1.0 (commit 1a2b3c4d5e6f)`: what `fencer --version` prints and a bug
/// report should quote; the commit comes from build.rs.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("FENCER_GIT_COMMIT"),
    ")"
);

pub mod admin;
pub mod bench;
pub mod check_config;
pub mod cli;
pub mod demo;
pub mod dev;
pub mod error;
pub mod error_chain;
pub mod etcd;
pub mod gateway;
pub mod hotaccount;
pub mod http;
pub mod inject;
pub mod lock;
pub mod lock_command;
pub mod metrics;
pub mod mutants;
pub mod mysql;
pub mod out;
pub mod pg;
pub mod proxy;
pub mod routes;
pub mod settings;
pub mod sidecar;
pub mod start;
pub mod storage;
pub mod telemetry;
pub mod token;
pub mod top;
