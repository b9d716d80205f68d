//! `gateway.keys_dir`: the gateway's signing keys from a directory laid out
//! as Kubernetes mounts a Secret — one file per key, the file name the key
//! id, its content the secret.
//!
//! Why a directory: the signing Secret (`fencer-signing`, keys `k1`, `k2`
//! during a rotation) is mounted at the same path in the sidecars and the
//! gateway, and a rotation then means adding a key to the Secret, not
//! editing every gateway's `[[gateway.keys]]` in step. Kubernetes puts its
//! own entries next to the keys (`..data`, `..2024_01_01_00_00_00.1`):
//! names starting with `.` are skipped, and so is anything that is not a
//! file once symlinks are followed. Every other name must be a valid key
//! id, and every secret as long as the file form requires: a stray file is
//! refused (exit 2) rather than accepted as a key nobody meant.

use crate::gateway::settings::GatewayKey;
use crate::settings::check::{check_key_id, check_secret, invalid, ConfigError};

const FIELD: &str = "gateway.keys_dir";

/// Most keys a directory may hold (a rotation needs two; bounds the reads).
const MAX_KEYS: usize = 64;

/// Reads every key of `dir`, sorted by key id; a directory without one is an
/// error (a Secret that was not mounted).
pub(crate) fn read(dir: &str) -> Result<Vec<GatewayKey>, ConfigError> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| invalid(FIELD, format!("cannot read {dir}: {e}")))?;
    let mut keys = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| invalid(FIELD, format!("cannot read {dir}: {e}")))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Err(invalid(
                FIELD,
                format!("{dir}: a file name is not UTF-8: {name:?}"),
            ));
        };
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Follows symlinks: a mounted Secret's keys are links into `..data`.
        let meta = std::fs::metadata(&path)
            .map_err(|e| invalid(FIELD, format!("{}: {e}", path.display())))?;
        if !meta.is_file() {
            continue;
        }
        check_key_id(FIELD, name).map_err(|_| {
            invalid(
                FIELD,
                format!(
                    "{}: a file name is a key id, 1 to 32 characters from [A-Za-z0-9_-]",
                    path.display()
                ),
            )
        })?;
        if keys.len() == MAX_KEYS {
            return Err(invalid(
                FIELD,
                format!("{dir} holds more than {MAX_KEYS} keys"),
            ));
        }
        let data = std::fs::read(&path)
            .map_err(|e| invalid(FIELD, format!("cannot read {}: {e}", path.display())))?;
        let secret = check_secret(FIELD, data.trim_ascii().to_vec()).map_err(|_| {
            invalid(
                FIELD,
                format!(
                    "{}: the signing secret must be at least 32 bytes",
                    path.display()
                ),
            )
        })?;
        keys.push((name.to_owned(), secret, Vec::new()));
    }
    if keys.is_empty() {
        return Err(invalid(
            FIELD,
            format!("{dir} holds no key (one file per key id, its content the secret)"),
        ));
    }
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn reads_a_mounted_secret_and_skips_kubernetes_entries() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("..2026_01_01_00_00_00.1");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("k2"), format!("{SECRET}2\n")).unwrap();
        std::fs::write(data.join("k1"), SECRET).unwrap();
        std::os::unix::fs::symlink(&data, dir.path().join("..data")).unwrap();
        for k in ["k1", "k2"] {
            std::os::unix::fs::symlink(format!("..data/{k}"), dir.path().join(k)).unwrap();
        }
        let keys = read(dir.path().to_str().unwrap()).unwrap();
        let ids: Vec<&str> = keys.iter().map(|k| k.0.as_str()).collect();
        assert_eq!(ids, ["k1", "k2"]);
        assert_eq!(keys[1].1, format!("{SECRET}2").into_bytes(), "trimmed");
    }

    #[test]
    fn a_bad_name_a_short_secret_or_no_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap();
        let e = read(path).unwrap_err().to_string();
        assert!(e.contains(FIELD) && e.contains("no key"), "{e}");
        std::fs::write(dir.path().join("k1"), "short").unwrap();
        let e = read(path).unwrap_err().to_string();
        assert!(e.contains("k1") && e.contains("32 bytes"), "{e}");
        std::fs::write(dir.path().join("k1"), SECRET).unwrap();
        std::fs::write(dir.path().join("k1.bak"), SECRET).unwrap();
        let e = read(path).unwrap_err().to_string();
        assert!(e.contains("k1.bak") && e.contains("key id"), "{e}");
        let e = read("/nonexistent/keys").unwrap_err().to_string();
        assert!(e.contains("/nonexistent/keys"), "{e}");
    }
}
