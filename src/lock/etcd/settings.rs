//! `[backend.etcd]`: the cluster, where fencer keeps its keys, and the
//! bound on each call.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::etcd::connection::{Connection, Fields};
use crate::etcd::ClientConfig;
use crate::http::tls_client::UpstreamTls;
use crate::settings::check::{check_range, invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EtcdSettings {
    /// `http://host:2379` or `https://host:2379` of every member (a call
    /// goes on to the next member when one cannot serve). An env list:
    /// `FENCER__BACKEND__ETCD__ENDPOINTS=http://a:2379,http://b:2379`.
    pub endpoints: Vec<String>,
    /// Prefix of every key fencer writes (`<prefix>/locks/…`), so several
    /// fleets can share a cluster.
    pub prefix: String,
    /// etcd user (authentication on); its password in `password_file` (a
    /// mounted Secret) or `password` — usually from
    /// `FENCER__BACKEND__ETCD__PASSWORD`, which an injected sidecar gets
    /// from its env Secret; never printed (`check-config` redacts it).
    pub user: Option<String>,
    pub password_file: Option<String>,
    pub password: Option<String>,
    /// CA, client certificate and key for `https://` endpoints.
    pub tls: UpstreamTls,
    /// Bound on one acquire try, renewal or release, every call of it
    /// together. An unanswered write has an unknown outcome; an acquire's
    /// retry finds its key by its name instead of queueing twice.
    pub request_timeout_ms: u64,
    /// Bound on opening a connection to one member.
    pub connect_timeout_ms: u64,
}

impl Default for EtcdSettings {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            prefix: "/fencer".into(),
            user: None,
            password_file: None,
            password: None,
            tls: UpstreamTls::default(),
            request_timeout_ms: 2_000,
            connect_timeout_ms: 1_000,
        }
    }
}

const FIELDS: Fields = Fields {
    endpoints: "backend.etcd.endpoints",
    prefix: "backend.etcd.prefix",
    user: "backend.etcd.user",
    password_file: "backend.etcd.password_file",
};

const WHY: &str = "when backend.kind = \"etcd\": http(s)://host:port of every member";

impl EtcdSettings {
    fn connection(&self) -> Connection<'_> {
        Connection {
            endpoints: &self.endpoints,
            prefix: &self.prefix,
            user: self.user.as_deref(),
            // An inline password stands for the file in the checks.
            password_file: self
                .password_file
                .as_deref()
                .or(self.password.as_ref().map(|_| "")),
            tls: &self.tls,
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
        }
    }

    /// `selected`: this is the configured backend, so it needs its
    /// members. Reads no file.
    pub(crate) fn validate(&self, selected: bool) -> Result<(), ConfigError> {
        check_range(
            "backend.etcd.request_timeout_ms",
            self.request_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "backend.etcd.connect_timeout_ms",
            self.connect_timeout_ms,
            10,
            60_000,
        )?;
        if self.password.is_some() && self.password_file.is_some() {
            return Err(invalid(
                "backend.etcd.password",
                "give password or password_file, not both",
            ));
        }
        if selected {
            self.connection().check(&FIELDS, WHY)?;
        }
        Ok(())
    }

    /// The client: settings checked, the password read from its file (or
    /// given inline).
    pub fn client_config(&self) -> Result<ClientConfig, ConfigError> {
        match (&self.user, &self.password) {
            (Some(user), Some(password)) => {
                let without = EtcdSettings {
                    user: None,
                    password: None,
                    ..self.clone()
                };
                let mut config = without.connection().client_config(&FIELDS, WHY)?;
                config.credentials = Some(crate::etcd::Credentials {
                    user: user.clone(),
                    password: password.clone(),
                });
                Ok(config)
            }
            _ => self.connection().client_config(&FIELDS, WHY),
        }
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_prefix_and_credentials_are_checked_without_reading_files() {
        let s = |endpoints: &[&str], prefix: &str| EtcdSettings {
            endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            prefix: prefix.into(),
            ..EtcdSettings::default()
        };
        let err = |e: EtcdSettings| e.validate(true).unwrap_err().to_string();
        assert!(err(s(&[], "/fencer")).contains("backend.etcd.endpoints"));
        assert!(s(&[], "/fencer").validate(false).is_ok(), "not selected");
        assert!(err(s(&["http://a:2379", "https://b:2379"], "/f")).contains("mixes"));
        for bad in ["fencer", "/", "/a//b", "/a/", "/a b"] {
            assert!(
                err(s(&["http://a:2379"], bad)).contains("backend.etcd.prefix"),
                "{bad}"
            );
        }
        let pw = EtcdSettings {
            user: Some("u".into()),
            password_file: Some("/nonexistent/pw".into()),
            ..s(&["http://a:2379"], "/fencer/a")
        };
        assert!(pw.validate(true).is_ok(), "no file read to validate");
        assert!(pw
            .client_config()
            .unwrap_err()
            .to_string()
            .contains("backend.etcd.password_file"));
        let half = EtcdSettings {
            user: Some("u".into()),
            ..s(&["http://a:2379"], "/fencer")
        };
        assert!(err(half).contains("backend.etcd.user"));
        let inline = EtcdSettings {
            user: Some("u".into()),
            password: Some("s3cret".into()),
            ..s(&["http://a:2379"], "/fencer")
        };
        assert!(inline.validate(true).is_ok());
        assert_eq!(
            inline
                .client_config()
                .unwrap()
                .credentials
                .unwrap()
                .password,
            "s3cret"
        );
        let both = EtcdSettings {
            password_file: Some("/p".into()),
            ..inline
        };
        assert!(err(both).contains("backend.etcd.password"));
    }
}
