//! etcd (issue 34): a client of the v3 API, for the lock backend and the
//! gateway's fence store.
//!
//! **Why the JSON gateway, not gRPC.** Every etcd since 3.4 serves its v3
//! API as JSON over HTTP on the client port (`/v3/kv/range`,
//! `/v3/kv/txn`, `/v3/lease/…`, `/v3/watch`), the same calls with the
//! same semantics as gRPC. The Rust gRPC clients generate their code with
//! `protoc` at build time, so every build of fencer — `cargo run --release
//! -- dev` on a fresh machine included — would need a protobuf compiler
//! installed; and their own transport would be a second HTTP stack, with
//! its own timeouts and pools to bound. Through the gateway, etcd is one
//! more upstream of fencer's own hyper client: its connector (TLS with a
//! private CA or client certificates, connect bound), its error chains,
//! and one deadline per call that this module enforces. The costs: JSON
//! (base64 keys, integers as strings) and a watch per HTTP connection —
//! a sidecar watches only the keys its head waiters wait for.
//!
//! [`client`]: the cluster — endpoints with failover, deadlines,
//! authentication; [`wire`]: the JSON forms; [`watch`]: a watch stream.

pub mod client;
pub mod connection;
pub mod error;
pub mod watch;
pub mod wire;

pub use client::{ClientConfig, Credentials, EtcdClient, Retry};
pub use error::EtcdError;
