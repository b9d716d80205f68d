//! `[gateway]`: the storage it guards, the keys it accepts, its fence store
//! and its time budget.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::http::tls_client::{UpstreamTls, GATEWAY};
use crate::settings::check::{
    check_key_id, check_methods, check_range, check_upstream_url, config_enum, invalid, ConfigError,
};

/// The etcd fence store's fields, named in its errors.
const ETCD_FIELDS: crate::etcd::connection::Fields = crate::etcd::connection::Fields {
    endpoints: "gateway.etcd_endpoints",
    prefix: "gateway.etcd_prefix",
    user: "gateway.etcd_user",
    password_file: "gateway.etcd_password_file",
};

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum FenceStoreKind {
    Memory,
    Postgres,
    Mysql,
    Etcd,
}
config_enum!(FenceStoreKind { Memory => "memory", Postgres => "postgres", Mysql => "mysql", Etcd => "etcd" });

/// One accepted signing key of the gateway (several during a rotation).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyKey {
    pub key_id: String,
    pub secret_file: Option<String>,
    pub secret_env: Option<String>,
    /// Lock keys this key may sign, by prefix (e.g. `["team-a/"]`); empty:
    /// any key. Give each team (namespace, application) its own key id and
    /// prefix, and a leaked secret signs only that team's keys.
    #[serde(default)]
    pub key_prefixes: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySettings {
    pub listen: SocketAddr,
    /// Serve `listen` over TLS with this PEM certificate chain (and
    /// `tls_key_file`); re-read when the files change. Unset: plain HTTP.
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
    /// With TLS: require every client (sidecar proxies, pre-registration)
    /// to present a certificate signed by a CA in this PEM bundle (mTLS).
    pub tls_client_ca_file: Option<String>,
    /// The storage: `http://host:port`, or `https://host:port` with TLS
    /// configured by `upstream_tls`.
    pub upstream: String,
    /// TLS to an `https://` storage: CA, client certificate, server name
    /// (docs/tls.md).
    pub upstream_tls: UpstreamTls,
    /// Off: a plain reverse proxy that checks nothing (for comparisons and
    /// staged roll-outs). Never run production writes with it off.
    pub enforce: bool,
    /// The methods that are reads: known not to change the storage. Every
    /// other method — any case, any extension method (`MOVE`, `COPY`,
    /// `MKCOL`, `PROPPATCH`, `MERGE`, `put`) — is a write and needs a token.
    /// An allow-list: a list of write methods let every method nobody had
    /// thought of through unfenced (issue 26 item 7).
    pub read_methods: Vec<String>,
    /// Deprecated and ignored for classification (every method outside
    /// `read_methods` is a write); still accepted so older files load, but
    /// a method listed here and in `read_methods` is a configuration error.
    pub write_methods: Vec<String>,
    /// Refuse (428) requests of *every* method without a token, not only
    /// writes: by default a read without a token is forwarded unchecked,
    /// from whoever can reach the gateway.
    pub require_token_for_reads: bool,
    /// Bind paths to keys: a write to `/accounts/7` must carry a token for
    /// `account:7`.
    pub routes: Vec<crate::routes::RouteSpec>,
    /// Accepted signing keys. Empty (and no `keys_dir`): the `[signing]` key.
    pub keys: Vec<VerifyKey>,
    /// A directory of keys besides `keys`, as Kubernetes mounts a Secret:
    /// each file name a key id, its content the secret
    /// (`settings::keys_dir`). The signing Secret mounted at one path in
    /// the sidecars and the gateway then serves both.
    pub keys_dir: Option<String>,
    /// Required for `fencer gateway`: `postgres`, `mysql` or `etcd`
    /// (durable, shared by replicas), or `memory` chosen explicitly for
    /// development (marks are lost on restart).
    pub fence_store: Option<FenceStoreKind>,
    /// `fence_store = "etcd"`: the members' client URLs
    /// (`http://host:2379` or `https://…`), any number of them; calls go
    /// to the one that answered last and on to the others.
    pub etcd_endpoints: Vec<String>,
    /// Prefix of every key the etcd store writes (`<prefix>/fence/…`).
    pub etcd_prefix: String,
    /// etcd user (authentication on); its password in
    /// `etcd_password_file`.
    pub etcd_user: Option<String>,
    pub etcd_password_file: Option<String>,
    /// TLS to the members (with `https://` endpoints): CA, client
    /// certificate.
    pub etcd_tls: UpstreamTls,
    /// Bound on one fence-store call with `fence_store = "etcd"`.
    pub etcd_request_timeout_ms: u64,
    pub postgres_url: String,
    pub postgres_ca_file: Option<String>,
    pub postgres_pool_size: usize,
    /// Bound on one fence-store call (check-and-advance, clearing a stamp)
    /// with `fence_store = "postgres"`.
    pub postgres_request_timeout_ms: u64,
    /// `mysql://user:password@host:3306/database` (MySQL 8 or MariaDB
    /// 10.11; `?require_ssl=true` for TLS). The server must run with
    /// `innodb_flush_log_at_trx_commit = 1` for acknowledged marks to
    /// survive its crash.
    pub mysql_url: String,
    /// CA certificate(s) that verify the server (turns TLS on).
    pub mysql_ca_file: Option<String>,
    pub mysql_pool_size: usize,
    /// Bound on one fence-store call with `fence_store = "mysql"`.
    pub mysql_request_timeout_ms: u64,
    /// How long a fenced request waits for the previous one on its key.
    pub serialize_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub upstream_timeout_ms: u64,
    /// After a forwarded write's outcome is unknown (timeout, reset), its key
    /// stays blocked this long, because the write may still land.
    pub uncertain_hold_ms: u64,
    /// Where sidecars pre-register tokens: `POST <prefix><key>`.
    pub fence_api_prefix: String,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8080".parse().expect("static addr"),
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            upstream: "http://127.0.0.1:8081".into(),
            upstream_tls: UpstreamTls::default(),
            enforce: true,
            read_methods: vec!["GET".into(), "HEAD".into()],
            write_methods: Vec::new(),
            require_token_for_reads: false,
            routes: Vec::new(),
            keys: Vec::new(),
            keys_dir: None,
            fence_store: None,
            etcd_endpoints: Vec::new(),
            etcd_prefix: "/fencer".into(),
            etcd_user: None,
            etcd_password_file: None,
            etcd_tls: UpstreamTls::default(),
            etcd_request_timeout_ms: 2_000,
            postgres_url: String::new(),
            postgres_ca_file: None,
            postgres_pool_size: 32,
            postgres_request_timeout_ms: 2_000,
            mysql_url: String::new(),
            mysql_ca_file: None,
            mysql_pool_size: 32,
            mysql_request_timeout_ms: 2_000,
            serialize_timeout_ms: 5_000,
            connect_timeout_ms: 1_000,
            upstream_timeout_ms: 10_000,
            uncertain_hold_ms: 10_000,
            fence_api_prefix: "/_fencer/v1/fences/".into(),
        }
    }
}

impl GatewaySettings {
    /// How long a fenced request's in-flight stamp keeps other replicas
    /// off its key were this gateway to die mid-forward: connecting,
    /// waiting for the storage, the uncertain hold, and clearing the stamp
    /// (two store calls), plus a second of slack.
    pub fn stamp_hold_ms(&self) -> u64 {
        self.connect_timeout_ms
            + self.upstream_timeout_ms
            + self.uncertain_hold_ms
            + 2 * self.store_request_timeout_ms()
            + 1_000
    }

    /// `fence_store = "etcd"`'s connection, as the shared checks see it.
    fn etcd_connection(&self) -> crate::etcd::connection::Connection<'_> {
        crate::etcd::connection::Connection {
            endpoints: &self.etcd_endpoints,
            prefix: &self.etcd_prefix,
            user: self.etcd_user.as_deref(),
            password_file: self.etcd_password_file.as_deref(),
            tls: &self.etcd_tls,
            connect_timeout: std::time::Duration::from_millis(self.connect_timeout_ms),
        }
    }

    /// `fence_store = "etcd"`'s settings, without reading a file.
    fn check_etcd(&self) -> Result<(), ConfigError> {
        self.etcd_connection()
            .check(&ETCD_FIELDS, "when gateway.fence_store = \"etcd\"")
    }

    /// The etcd client of `fence_store = "etcd"`: settings checked, the
    /// password read from its file.
    pub fn etcd_client_config(&self) -> Result<crate::etcd::ClientConfig, ConfigError> {
        self.etcd_connection()
            .client_config(&ETCD_FIELDS, "when gateway.fence_store = \"etcd\"")
    }

    /// The bound on one call to the selected fence store.
    pub fn store_request_timeout_ms(&self) -> u64 {
        match self.fence_store {
            Some(FenceStoreKind::Mysql) => self.mysql_request_timeout_ms,
            Some(FenceStoreKind::Etcd) => self.etcd_request_timeout_ms,
            _ => self.postgres_request_timeout_ms,
        }
    }

    /// The longest a request can spend in the gateway before the storage
    /// answers: waiting for its key, connecting, the storage's time. The
    /// sidecar's proxy must wait longer than this (`proxy.upstream_timeout_ms`).
    pub fn answer_budget_ms(&self) -> u64 {
        self.serialize_timeout_ms + self.connect_timeout_ms + self.upstream_timeout_ms
    }
}

/// One key the gateway accepts: key id, secret, allowed key prefixes.
pub type GatewayKey = (String, Vec<u8>, Vec<String>);

impl GatewaySettings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let g = self;
        let scheme = check_upstream_url("gateway.upstream", &g.upstream)?;
        g.upstream_tls.validate(GATEWAY, scheme)?;
        if g.tls_cert_file.is_some() != g.tls_key_file.is_some() {
            return Err(invalid(
                "gateway.tls_cert_file",
                "give tls_cert_file and tls_key_file together (or neither)",
            ));
        }
        if g.tls_client_ca_file.is_some() && g.tls_cert_file.is_none() {
            return Err(invalid(
                "gateway.tls_client_ca_file",
                "client certificates need TLS: set tls_cert_file and tls_key_file too",
            ));
        }
        check_methods("gateway.read_methods", &g.read_methods)?;
        check_methods("gateway.write_methods", &g.write_methods)?;
        if let Some(m) = g.write_methods.iter().find(|m| g.read_methods.contains(m)) {
            return Err(invalid(
                "gateway.write_methods",
                format!(
                    "`{m}` is in both gateway.read_methods and gateway.write_methods; write_methods is deprecated (every method outside read_methods is a write): remove it"
                ),
            ));
        }
        crate::routes::Routes::compile(&g.routes)
            .map_err(|e| invalid("gateway.routes", e.to_string()))?;
        for (i, k) in g.keys.iter().enumerate() {
            check_key_id("gateway.keys.key_id", &k.key_id)?;
            if g.keys[..i].iter().any(|o| o.key_id == k.key_id) {
                return Err(invalid(
                    "gateway.keys.key_id",
                    format!(
                        "key id `{}` is listed twice; each key id names one secret",
                        k.key_id
                    ),
                ));
            }
            if k.secret_file.is_some() == k.secret_env.is_some() {
                return Err(invalid(
                    "gateway.keys",
                    format!(
                        "key `{}`: set exactly one of secret_file, secret_env",
                        k.key_id
                    ),
                ));
            }
        }
        if g.fence_store == Some(FenceStoreKind::Postgres) && g.postgres_url.is_empty() {
            return Err(invalid(
                "gateway.postgres_url",
                "required when gateway.fence_store = \"postgres\"",
            ));
        }
        if g.fence_store == Some(FenceStoreKind::Mysql) {
            if g.mysql_url.is_empty() {
                return Err(invalid(
                    "gateway.mysql_url",
                    "required when gateway.fence_store = \"mysql\"",
                ));
            }
            crate::mysql::opts(&crate::mysql::MyOptions {
                url: &g.mysql_url,
                ca_file: None,
                pool_size: 1,
                statement_timeout: std::time::Duration::from_secs(1),
            })
            .map_err(|e| invalid("gateway.mysql_url", e))?;
            if let Some(ca) = &g.mysql_ca_file {
                std::fs::metadata(ca)
                    .map_err(|e| invalid("gateway.mysql_ca_file", format!("{ca}: {e}")))?;
            }
        }
        if g.fence_store == Some(FenceStoreKind::Etcd) {
            g.check_etcd()?;
        }
        check_range(
            "gateway.etcd_request_timeout_ms",
            g.etcd_request_timeout_ms,
            10,
            60_000,
        )?;
        check_range("gateway.mysql_pool_size", g.mysql_pool_size as u64, 1, 1024)?;
        check_range(
            "gateway.mysql_request_timeout_ms",
            g.mysql_request_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "gateway.postgres_pool_size",
            g.postgres_pool_size as u64,
            1,
            1024,
        )?;
        check_range(
            "gateway.serialize_timeout_ms",
            g.serialize_timeout_ms,
            10,
            600_000,
        )?;
        check_range(
            "gateway.connect_timeout_ms",
            g.connect_timeout_ms,
            10,
            60_000,
        )?;
        check_range(
            "gateway.upstream_timeout_ms",
            g.upstream_timeout_ms,
            10,
            600_000,
        )?;
        check_range(
            "gateway.uncertain_hold_ms",
            g.uncertain_hold_ms,
            0,
            3_600_000,
        )?;
        check_range(
            "gateway.postgres_request_timeout_ms",
            g.postgres_request_timeout_ms,
            10,
            60_000,
        )?;
        if !g.fence_api_prefix.starts_with('/') || !g.fence_api_prefix.ends_with('/') {
            return Err(invalid(
                "gateway.fence_api_prefix",
                "must start and end with `/`",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The etcd fence store's settings are checked without reading a file
    /// (`check-config --no-files` in CI renders); the password file is
    /// read when the client is built.
    #[test]
    fn etcd_settings_are_checked_and_the_password_read_only_for_the_client() {
        let etcd = |endpoints: &[&str], user: Option<&str>, file: Option<&str>| GatewaySettings {
            fence_store: Some(FenceStoreKind::Etcd),
            etcd_endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            etcd_user: user.map(str::to_owned),
            etcd_password_file: file.map(str::to_owned),
            ..GatewaySettings::default()
        };
        let err = |g: GatewaySettings| g.validate().unwrap_err().to_string();
        assert!(err(etcd(&[], None, None)).contains("gateway.etcd_endpoints"));
        assert!(err(etcd(&["http://a:2379", "https://b:2379"], None, None)).contains("mixes"));
        assert!(err(etcd(&["ftp://a:2379"], None, None)).contains("gateway.etcd_endpoints"));
        assert!(err(etcd(&["http://a:2379"], Some("u"), None)).contains("gateway.etcd_user"));
        let missing = etcd(&["http://a:2379"], Some("u"), Some("/nonexistent/pw"));
        assert!(missing.validate().is_ok(), "no file read to validate");
        assert!(missing
            .etcd_client_config()
            .unwrap_err()
            .to_string()
            .contains("gateway.etcd_password_file"));
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("pw");
        std::fs::write(&pw, "s3cret\n").unwrap();
        let ok = etcd(&["http://a:2379"], Some("u"), Some(pw.to_str().unwrap()));
        let c = ok.etcd_client_config().unwrap();
        assert_eq!(c.credentials.unwrap().password, "s3cret");
    }

    /// `write_methods` can no longer let anything through: a method listed
    /// as both is refused rather than resolved either way.
    #[test]
    fn a_method_cannot_be_both_a_read_and_a_write() {
        let g = GatewaySettings {
            write_methods: vec!["PUT".into(), "GET".into()],
            ..GatewaySettings::default()
        };
        let e = g.validate().unwrap_err().to_string();
        assert!(
            e.contains("gateway.write_methods") && e.contains("`GET`"),
            "{e}"
        );
        let old = GatewaySettings {
            write_methods: vec!["PUT".into(), "POST".into()],
            ..GatewaySettings::default()
        };
        assert!(old.validate().is_ok());
        let lower = GatewaySettings {
            read_methods: vec!["get".into()],
            ..GatewaySettings::default()
        };
        assert!(lower.validate().is_err());
        assert_eq!(GatewaySettings::default().read_methods, ["GET", "HEAD"]);
    }

    #[test]
    fn the_stamp_hold_counts_the_selected_stores_timeout() {
        let mut g = GatewaySettings {
            postgres_request_timeout_ms: 3_000,
            mysql_request_timeout_ms: 500,
            ..GatewaySettings::default()
        };
        let base = g.connect_timeout_ms + g.upstream_timeout_ms + g.uncertain_hold_ms + 1_000;
        g.fence_store = Some(FenceStoreKind::Postgres);
        assert_eq!(g.stamp_hold_ms(), base + 6_000);
        g.fence_store = Some(FenceStoreKind::Mysql);
        assert_eq!(g.stamp_hold_ms(), base + 1_000);
        assert_eq!(
            FenceStoreKind::try_from("mysql".to_owned()),
            Ok(FenceStoreKind::Mysql)
        );
    }
}
