//! The files a configuration points at: each must exist, be a readable
//! file, and parse as what the role will make of it at start-up.
//!
//! Why here and not only at start: a pod whose Secret mount is missing a
//! key crash-loops with exit 2; `check-config` in CI or an init step says
//! which field and which file before anything is rolled out.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::settings::ConfigError;

/// Bound on what a check reads of one file: certificates, keys and
/// secrets are a few KiB; anything this large is the wrong file.
const MAX_FILE_BYTES: u64 = 1 << 20;

fn invalid(field: &'static str, message: String) -> ConfigError {
    ConfigError::Invalid { field, message }
}

/// The file's bytes: it exists, is a regular file, is readable, is not
/// empty and not absurdly large.
pub(crate) fn read(field: &'static str, path: &str) -> Result<Vec<u8>, ConfigError> {
    let meta = std::fs::metadata(path).map_err(|e| invalid(field, format!("{path}: {e}")))?;
    if !meta.is_file() {
        return Err(invalid(field, format!("{path}: not a regular file")));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(invalid(
            field,
            format!("{path}: {} bytes, more than a certificate, key or secret ({MAX_FILE_BYTES} at most)", meta.len()),
        ));
    }
    let data =
        std::fs::read(path).map_err(|e| invalid(field, format!("{path}: cannot read: {e}")))?;
    if data.trim_ascii().is_empty() {
        return Err(invalid(field, format!("{path}: empty")));
    }
    Ok(data)
}

/// PEM certificates (a CA bundle or a chain): at least one, each a
/// parseable `CERTIFICATE` block. Returns how many.
pub(crate) fn certificates(field: &'static str, path: &str) -> Result<usize, ConfigError> {
    let data = read(field, path)?;
    // Parsed as X.509 the way the TLS clients take a CA (a PEM block of
    // garbage decodes to DER but is no certificate).
    let mut roots = rustls::RootCertStore::empty();
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(&data) {
        let cert =
            cert.map_err(|e| invalid(field, format!("{path}: not a PEM certificate: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| invalid(field, format!("{path}: certificate {}: {e}", n + 1)))?;
        n += 1;
    }
    if n == 0 {
        return Err(invalid(
            field,
            format!("{path}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it"),
        ));
    }
    Ok(n)
}

/// A PEM private key (PKCS#8, PKCS#1 or SEC1), as the TLS clients and the
/// injector read it.
pub(crate) fn private_key(field: &'static str, path: &str) -> Result<(), ConfigError> {
    let data = read(field, path)?;
    PrivateKeyDer::from_pem_slice(&data)
        .map(|_| ())
        .map_err(|e| invalid(field, format!("{path}: not a PEM private key: {e}")))
}

/// Runs each check and keeps every failure: an operator fixing a Secret
/// wants all its missing keys at once, not one per run.
#[derive(Default)]
pub(crate) struct Findings {
    pub errors: Vec<ConfigError>,
}

impl Findings {
    pub fn check<T>(&mut self, result: Result<T, ConfigError>) {
        if let Err(e) = result {
            self.errors.push(e);
        }
    }

    /// `certificates` for an optional CA/cert setting.
    pub fn certs(&mut self, field: &'static str, path: Option<&str>) {
        if let Some(p) = path {
            self.check(certificates(field, p));
        }
    }

    /// `private_key` for an optional key setting.
    pub fn key(&mut self, field: &'static str, path: Option<&str>) {
        if let Some(p) = path {
            self.check(private_key(field, p));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_directory_and_non_pem_files_name_field_and_path() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let e = certificates("backend.redis.ca_file", &format!("{d}/nope.pem")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("backend.redis.ca_file") && text.contains("nope.pem"),
            "{text}"
        );
        assert!(read("signing.secret_file", d)
            .unwrap_err()
            .to_string()
            .contains("not a regular file"));
        let junk = format!("{d}/junk.pem");
        std::fs::write(&junk, "hello\n").unwrap();
        assert!(certificates("f", &junk)
            .unwrap_err()
            .to_string()
            .contains("no PEM certificate"));
        assert!(private_key("f", &junk).is_err());
        let empty = format!("{d}/empty");
        std::fs::write(&empty, "\n").unwrap();
        assert!(read("f", &empty).unwrap_err().to_string().contains("empty"));
    }
}
