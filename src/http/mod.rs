//! HTTP plumbing shared by every role: the one bounded server
//! ([`server`]), what bounds a connection's silence ([`conn`]) and the
//! descriptor limit ([`pressure`]), and binding and serving listeners
//! ([`listen`]). Neither the sidecar nor the gateway imports from the
//! other; both import from here.

pub mod conn;
pub mod listen;
pub mod pressure;
pub mod server;
pub mod tls_cert;
pub mod tls_client;
pub mod tls_listen;
pub mod tls_roots;
