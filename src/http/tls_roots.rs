//! The certificates that verify a server: a CA file's PEM bundle or the
//! public web roots. A leaf module (no settings, no metrics) because every
//! TLS client needs it — the upstream links, the gateway's client-CA check
//! and the PostgreSQL connections — and the last of those sits below the
//! settings in the module graph.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

/// The roots that verify a server: the PEM bundle at `ca_file`, else the
/// public web roots.
pub fn roots(ca_file: Option<&str>) -> Result<rustls::RootCertStore, String> {
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
            if roots.is_empty() {
                return Err(format!("CA file {path}: no certificate"));
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    Ok(roots)
}
