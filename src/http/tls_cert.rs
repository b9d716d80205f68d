//! A listener's TLS certificate (the injector's webhook, the gateway),
//! re-read when its files change.
//!
//! cert-manager (and a Helm upgrade with generated certificates) replace
//! the Secret in place; the kubelet updates the mounted files within about
//! a minute. A server that read them once would serve an expired
//! certificate until restarted, and the API server — failing to reach the
//! webhook — would then admit pods without fencer (failurePolicy Ignore)
//! or refuse every pod (Fail).

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::sync::CancellationToken;

/// How often the files' modification times are compared.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct ReloadingCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    stamp: (Option<SystemTime>, Option<SystemTime>),
}

impl ReloadingCert {
    /// Loads the pair once; a missing or bad pair is a start-up error.
    pub fn load(cert_file: &str, key_file: &str) -> Result<Arc<ReloadingCert>, String> {
        let (cert_file, key_file) = (PathBuf::from(cert_file), PathBuf::from(key_file));
        let stamp = stamp(&cert_file, &key_file);
        let key = read_pair(&cert_file, &key_file)?;
        Ok(Arc::new(ReloadingCert {
            cert_file,
            key_file,
            current: RwLock::new(Loaded { key, stamp }),
        }))
    }

    /// Re-reads the pair if either file changed. A pair that does not load
    /// (caught between the two files' updates, say) keeps the old one and
    /// is retried on the next round.
    pub fn reload_if_changed(&self) -> Option<Result<(), String>> {
        let now = stamp(&self.cert_file, &self.key_file);
        if now == self.current.read().expect("not poisoned").stamp {
            return None;
        }
        Some(read_pair(&self.cert_file, &self.key_file).map(|key| {
            *self.current.write().expect("not poisoned") = Loaded { key, stamp: now };
        }))
    }

    /// Polls the files until `shutdown`, counting each reload in
    /// `reloads{result}` (ok, error); `what` names the listener in logs.
    pub async fn watch(
        self: Arc<Self>,
        what: &'static str,
        reloads: prometheus::IntCounterVec,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(RELOAD_INTERVAL) => {}
                _ = shutdown.cancelled() => return,
            }
            match self.reload_if_changed() {
                None => {}
                Some(Ok(())) => {
                    reloads.with_label_values(&["ok"]).inc();
                    tracing::info!(listener = what, cert = %self.cert_file.display(), "TLS certificate reloaded");
                }
                Some(Err(e)) => {
                    reloads.with_label_values(&["error"]).inc();
                    tracing::warn!(listener = what, error = %e, "TLS certificate changed but does not load; serving the previous one");
                }
            }
        }
    }

    pub fn server_config(self: &Arc<Self>) -> rustls::ServerConfig {
        self.server_config_with(None)
            .expect("no client verifier to build")
    }

    /// The server configuration; with `client_ca` (a PEM bundle) every
    /// client must present a certificate that CA signed (mTLS).
    pub fn server_config_with(
        self: &Arc<Self>,
        client_ca: Option<&str>,
    ) -> Result<rustls::ServerConfig, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let roots = super::tls_roots::roots(Some(path))?;
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| format!("client CA file {path}: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("not poisoned").key.clone())
    }
}

fn stamp(cert: &PathBuf, key: &PathBuf) -> (Option<SystemTime>, Option<SystemTime>) {
    let mtime = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    (mtime(cert), mtime(key))
}

fn read_pair(cert_file: &PathBuf, key_file: &PathBuf) -> Result<Arc<CertifiedKey>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| format!("{}: {e}", cert_file.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate", cert_file.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| format!("{}: {e}", key_file.display()))?;
    let provider = rustls::crypto::ring::default_provider();
    let certified = CertifiedKey::from_der(chain, key, &provider)
        .map_err(|e| format!("{} / {}: {e}", cert_file.display(), key_file.display()))?;
    Ok(Arc::new(certified))
}
