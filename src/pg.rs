//! PostgreSQL connections, shared by the lock backend, the gateway's fence
//! store and the demo storage: one place that builds pools and TLS.
//!
//! TLS follows the URL's `sslmode`: `require` connects with TLS and always
//! verifies the server certificate (chain and host name) against the
//! configured CA file, or the public web roots if none is given; `disable`
//! and `prefer` (the default) connect in plain text. fencer does not do
//! libpq's unverified opportunistic TLS: encryption without authentication
//! would only look safe.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tokio_postgres_rustls::MakeRustlsConnect;

pub type Tls = MakeRustlsConnect;

pub struct PgOptions<'a> {
    pub url: &'a str,
    pub application_name: &'a str,
    pub ca_file: Option<&'a str>,
    pub pool_size: usize,
    pub connect_timeout: Duration,
    /// How long a caller waits for a pooled connection.
    pub wait_timeout: Duration,
    /// Extra server settings (`-c name=value …`), e.g. a lock timeout.
    pub server_options: Option<String>,
}

/// Installs the process-wide TLS crypto provider (ring). Idempotent.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

pub fn tls(ca_file: Option<&str>) -> Result<Tls, String> {
    install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in
                CertificateDer::pem_file_iter(path).map_err(|e| format!("CA file {path}: {e}"))?
            {
                let cert = cert.map_err(|e| format!("CA file {path}: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("CA file {path}: {e}"))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

/// The parsed connection config (with application name and options) and a
/// pool over it.
pub fn pool(o: &PgOptions<'_>) -> Result<(tokio_postgres::Config, Tls, Pool), String> {
    let mut config: tokio_postgres::Config = o
        .url
        .parse()
        .map_err(|e| format!("bad PostgreSQL URL: {e}"))?;
    config
        .connect_timeout(o.connect_timeout)
        .application_name(o.application_name);
    if let Some(opts) = &o.server_options {
        config.options(opts);
    }
    if config.get_ssl_mode() != tokio_postgres::config::SslMode::Require {
        config.ssl_mode(tokio_postgres::config::SslMode::Disable);
    }
    let tls = tls(o.ca_file)?;
    let manager = Manager::from_config(
        config.clone(),
        tls.clone(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(o.pool_size)
        .wait_timeout(Some(o.wait_timeout))
        .create_timeout(Some(o.connect_timeout))
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| e.to_string())?;
    Ok((config, tls, pool))
}
