//! What an etcd call can end in (a leaf module: the client and the watch
//! stream both answer with it).

/// Why a call did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EtcdError {
    /// No member answered in time, or none could serve (no leader, a
    /// leader change): a write's outcome is unknown.
    #[error("etcd unavailable: {0}")]
    Unavailable(String),
    /// A member answered with a final error (a bad request, a lease or
    /// revision that no longer exists, permission denied).
    #[error("etcd refused ({code}): {message}")]
    Rejected { code: i32, message: String },
    /// An answer that is not the API's.
    #[error("etcd protocol: {0}")]
    Protocol(String),
}
