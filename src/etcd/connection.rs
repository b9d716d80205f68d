//! How to reach an etcd cluster, as settings: checked the same way for
//! the lock backend (`[backend.etcd]`) and the gateway's fence store
//! (`gateway.etcd_*`), whose tables name the fields differently.

use std::time::Duration;

use super::client::{ClientConfig, Credentials, LINK};
use crate::http::tls_client::UpstreamTls;
use crate::settings::check::{check_upstream_url, invalid, ConfigError};

/// The names of the fields in the table being checked, for its errors.
pub struct Fields {
    pub endpoints: &'static str,
    pub prefix: &'static str,
    pub user: &'static str,
    pub password_file: &'static str,
}

/// One table's connection settings.
pub struct Connection<'a> {
    pub endpoints: &'a [String],
    pub prefix: &'a str,
    pub user: Option<&'a str>,
    pub password_file: Option<&'a str>,
    pub tls: &'a UpstreamTls,
    pub connect_timeout: Duration,
}

impl Connection<'_> {
    /// Every setting, without reading a file (`check-config` reads files
    /// only when asked to).
    pub fn check(&self, f: &Fields, why: &str) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() {
            return Err(invalid(f.endpoints, format!("required {why}")));
        }
        if self.endpoints.len() > 15 {
            return Err(invalid(f.endpoints, "at most 15 members"));
        }
        let mut scheme = None;
        for e in self.endpoints {
            let s = check_upstream_url(f.endpoints, e)?;
            if scheme.is_some_and(|first| first != s) {
                return Err(invalid(f.endpoints, "mixes http:// and https:// endpoints"));
            }
            scheme = Some(s);
        }
        self.tls.validate(LINK, scheme.unwrap_or("http"))?;
        let segments_ok = self.prefix.len() <= 256
            && self.prefix[1.min(self.prefix.len())..]
                .split('/')
                .all(|seg| !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_graphic()));
        if !self.prefix.starts_with('/') || !segments_ok {
            return Err(invalid(
                f.prefix,
                "an absolute path like /fencer: non-empty segments of printable ASCII, no trailing /, at most 256 bytes",
            ));
        }
        if self.user.is_some() != self.password_file.is_some() {
            return Err(invalid(
                f.user,
                format!(
                    "give {} and {} together (or neither)",
                    f.user, f.password_file
                ),
            ));
        }
        Ok(())
    }

    /// The client's configuration: settings checked, the password read
    /// from its file.
    pub fn client_config(&self, f: &Fields, why: &str) -> Result<ClientConfig, ConfigError> {
        self.check(f, why)?;
        let credentials = match (self.user, self.password_file) {
            (Some(user), Some(file)) => Some(Credentials {
                user: user.to_owned(),
                password: std::fs::read_to_string(file)
                    .map_err(|e| invalid(f.password_file, format!("{file}: {e}")))?
                    .trim_end_matches(['\n', '\r'])
                    .to_owned(),
            }),
            _ => None, // refused by check unless both are absent
        };
        Ok(ClientConfig {
            endpoints: self.endpoints.to_vec(),
            connect_timeout: self.connect_timeout,
            credentials,
            tls: self.tls.clone(),
        })
    }
}
