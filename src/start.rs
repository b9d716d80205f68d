//! Why a role could not start: configuration, listeners, backends.
//! `main` maps a configuration error to exit code 2, anything else to 1.

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot listen on unix socket {path} ({what}): {source}")]
    BindUnix {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(#[from] crate::settings::check::ConfigError),
    #[error("backend: {0}")]
    Backend(#[from] crate::lock::BackendError),
    #[error("fence store: {0}")]
    Store(String),
}

impl StartError {
    pub fn config(field: &'static str, message: impl std::fmt::Display) -> StartError {
        StartError::Config(crate::settings::check::ConfigError::Invalid {
            field,
            message: message.to_string(),
        })
    }
}
