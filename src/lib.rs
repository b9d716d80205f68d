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

pub mod admin;
pub mod bench;
pub mod cli;
pub mod demo;
pub mod dev;
pub mod error;
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
