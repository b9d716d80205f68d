//! HTTP plumbing shared by every role: the one bounded server
//! ([`server`]) and binding and serving listeners ([`listen`]). Neither the
//! sidecar nor the gateway imports from the other; both import from here.

pub mod listen;
pub mod server;
