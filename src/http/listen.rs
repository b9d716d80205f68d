//! Binding listeners and serving axum routers on them — for every role
//! (lock API, admin, demo storage), with the bounds of [`super::server`].

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::conn::Silence;
use crate::start::StartError;

/// Binds a TCP listener, naming `what` in the error.
pub async fn bind(
    what: &'static str,
    addr: std::net::SocketAddr,
) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { what, addr, source })
}

/// Binds a Unix socket at `path`, replacing a stale socket left by a
/// previous run (but never a file of another kind), readable and writable
/// by owner and group only: in Kubernetes the application container shares
/// the pod's `fsGroup`.
pub fn bind_unix(what: &'static str, path: &str) -> Result<UnixSocket, StartError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |source| StartError::BindUnix {
        what,
        path: path.to_owned(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            )));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(err)?;
    Ok(UnixSocket {
        listener: Some(listener),
        path: path.into(),
    })
}

/// A bound Unix socket; its file is removed when this is dropped.
pub struct UnixSocket {
    listener: Option<tokio::net::UnixListener>,
    path: std::path::PathBuf,
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What the listeners below serve: an axum router, or a service in front
/// of one (the lock API's hot routes, `crate::sidecar::api_hot`).
pub trait RouterService:
    tower::Service<
        hyper::Request<hyper::body::Incoming>,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
    > + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> RouterService for S where
    S: tower::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static
{
}

/// Serves `router` (an axum router, or a service in front of one) on a
/// Unix socket until `shutdown`.
pub async fn serve_unix<S>(
    mut socket: UnixSocket,
    router: S,
    silence: Silence,
    shutdown: CancellationToken,
) where
    S: RouterService,
    S::Future: Send + 'static,
{
    let listener = socket.listener.take().expect("served once");
    serve_router("api_unix", listener, router, silence, shutdown).await;
    drop(socket);
}

async fn serve_router<L: super::server::Accept, S>(
    name: &'static str,
    listener: L,
    router: S,
    silence: Silence,
    shutdown: CancellationToken,
) where
    S: RouterService,
    S::Future: Send + 'static,
{
    let service = hyper_util::service::TowerToHyperService::new(router);
    // The bounds of the HTTP servers built from axum routers (lock API,
    // admin, demo storage).
    let limits = super::server::Limits {
        listener: name,
        header_read_timeout: Duration::from_secs(10),
        max_connections: 16_384,
        drain: Duration::from_secs(2),
        silence,
    };
    super::server::serve_service(listener, service, shutdown, limits).await;
}

/// Serves `router` on `listener` until `shutdown`, then drains in-flight
/// requests (bounded: silence, header read time, connections, drain time).
/// `name` labels its connections in `fencer_http_connections`.
pub async fn serve<S>(
    name: &'static str,
    listener: TcpListener,
    router: S,
    silence: Silence,
    shutdown: CancellationToken,
) where
    S: RouterService,
    S::Future: Send + 'static,
{
    serve_router(name, listener, router, silence, shutdown).await;
}
