//! The effective configuration as TOML: redacted, only the sections the
//! role reads, each value an environment variable set marked with it.
//!
//! TOML, not a debug dump, so an operator can read it like the file they
//! wrote and keep it: the output loads back as a configuration file with
//! the same settings (passwords aside, which print as `REDACTED`).

use std::collections::BTreeMap;

use serde::Serialize;

use super::role::Role;
use crate::settings::*;

/// The sections one role reads, in the order of the example files.
#[derive(Serialize, Default)]
struct View<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    sidecar: Option<&'a SidecarSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    proxy: Option<&'a ProxySettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gateway: Option<GatewayView<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    storage: Option<&'a StorageSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    inject: Option<&'a InjectSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    backend: Option<BackendView<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    admin: Option<&'a AdminSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    http: Option<&'a HttpSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    signing: Option<&'a SigningSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    log: Option<&'a LogSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tracing: Option<&'a TracingSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics: Option<&'a MetricsSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    runtime: Option<&'a RuntimeSettings>,
}

/// A gateway's whole section, or what a sidecar's file says of its
/// gateway: the time budget its proxy must outwait.
#[derive(Serialize)]
#[serde(untagged)]
enum GatewayView<'a> {
    Full(&'a GatewaySettings),
    Budget {
        serialize_timeout_ms: u64,
        connect_timeout_ms: u64,
        upstream_timeout_ms: u64,
    },
}

/// `[backend]` with only the selected backend's subsection (all of them
/// when no role is known).
#[derive(Serialize)]
struct BackendView<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<BackendKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    redis: Option<&'a RedisSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    redlock: Option<&'a RedLockSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres: Option<&'a PostgresSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zookeeper: Option<&'a crate::lock::settings::ZooKeeperSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mysql: Option<&'a crate::lock::settings::MySqlSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    etcd: Option<&'a crate::lock::settings::EtcdSettings>,
}

impl<'a> BackendView<'a> {
    fn of(b: &'a BackendSettings, all: bool) -> BackendView<'a> {
        let pick = |k: BackendKind| all || b.kind == Some(k);
        BackendView {
            kind: b.kind,
            redis: pick(BackendKind::Redis).then_some(&b.redis),
            redlock: pick(BackendKind::RedLock).then_some(&b.redlock),
            postgres: pick(BackendKind::Postgres).then_some(&b.postgres),
            zookeeper: pick(BackendKind::ZooKeeper).then_some(&b.zookeeper),
            mysql: pick(BackendKind::MySql).then_some(&b.mysql),
            etcd: pick(BackendKind::Etcd).then_some(&b.etcd),
        }
    }
}

impl<'a> View<'a> {
    /// `role` None: every section (nothing says which ones count).
    fn of(s: &'a Settings, role: Option<Role>) -> View<'a> {
        let shared = || View {
            http: Some(&s.http),
            log: Some(&s.log),
            tracing: Some(&s.tracing),
            runtime: Some(&s.runtime),
            ..View::default()
        };
        let with_admin = View {
            admin: Some(&s.admin),
            ..shared()
        };
        match role {
            Some(Role::Sidecar) => View {
                sidecar: Some(&s.sidecar),
                proxy: Some(&s.proxy),
                gateway: Some(GatewayView::Budget {
                    serialize_timeout_ms: s.gateway.serialize_timeout_ms,
                    connect_timeout_ms: s.gateway.connect_timeout_ms,
                    upstream_timeout_ms: s.gateway.upstream_timeout_ms,
                }),
                backend: Some(BackendView::of(&s.backend, false)),
                signing: Some(&s.signing),
                metrics: Some(&s.metrics),
                ..with_admin
            },
            Some(Role::Gateway) => View {
                gateway: Some(GatewayView::Full(&s.gateway)),
                signing: Some(&s.signing),
                metrics: Some(&s.metrics),
                ..with_admin
            },
            Some(Role::Inject) => View {
                inject: Some(&s.inject),
                ..with_admin
            },
            Some(Role::Storage) => View {
                storage: Some(&s.storage),
                ..shared()
            },
            // The in-process stores are forced; the rest is read.
            Some(Role::Dev) => View {
                sidecar: Some(&s.sidecar),
                proxy: Some(&s.proxy),
                gateway: Some(GatewayView::Full(&s.gateway)),
                storage: Some(&s.storage),
                signing: Some(&s.signing),
                metrics: Some(&s.metrics),
                ..with_admin
            },
            None => View {
                sidecar: Some(&s.sidecar),
                proxy: Some(&s.proxy),
                gateway: Some(GatewayView::Full(&s.gateway)),
                storage: Some(&s.storage),
                inject: Some(&s.inject),
                backend: Some(BackendView::of(&s.backend, true)),
                signing: Some(&s.signing),
                metrics: Some(&s.metrics),
                ..with_admin
            },
        }
    }
}

/// `FENCER__A__B_C` variables by the dotted setting they set (`a.b_c`),
/// the way the loader maps them.
pub(crate) fn env_settings(
    vars: impl Iterator<Item = (String, String)>,
) -> BTreeMap<String, String> {
    vars.filter_map(|(k, _)| {
        let rest = k.strip_prefix("FENCER__")?;
        Some((rest.to_lowercase().replace("__", "."), k))
    })
    .collect()
}

/// The role's sections of `settings` (already redacted) as TOML, each
/// line whose setting a variable in `env` set ending in `# VARIABLE`.
pub(crate) fn render(
    settings: &Settings,
    role: Option<Role>,
    env: &BTreeMap<String, String>,
) -> Result<String, toml::ser::Error> {
    let text = toml::to_string(&View::of(settings, role))?;
    Ok(annotate(&text, env))
}

/// Appends `# VARIABLE` to each `key = value` line a variable set. TOML
/// as `toml` writes it: one value per line, `[a.b]`/`[[a.b]]` headers.
fn annotate(text: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut table = String::new();
    let mut in_multiline = false;
    for line in text.lines() {
        out.push_str(line);
        let quotes = line.matches("\"\"\"").count() + line.matches("'''").count();
        let was_multiline = in_multiline;
        in_multiline ^= quotes % 2 == 1;
        if !was_multiline {
            if let Some(h) = line.strip_prefix("[[").and_then(|l| l.strip_suffix("]]")) {
                table = h.to_owned();
            } else if let Some(h) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                table = h.to_owned();
            } else if let Some((key, _)) = line.split_once(" = ") {
                let path = if table.is_empty() {
                    key.to_owned()
                } else {
                    format!("{table}.{key}")
                };
                if let Some(var) = env.get(&path) {
                    out.push_str("  # ");
                    out.push_str(var);
                }
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_mark_their_lines_only() {
        let env = env_settings(
            [
                ("FENCER__BACKEND__REDIS__URL".to_owned(), String::new()),
                ("FENCER__LOG__LEVEL".to_owned(), String::new()),
                ("FENCER_CONFIG".to_owned(), String::new()),
                ("HOME".to_owned(), String::new()),
            ]
            .into_iter(),
        );
        assert_eq!(env.len(), 2, "{env:?}");
        let text = "[log]\nlevel = \"info\"\nformat = \"text\"\n\n[backend.redis]\nurl = \"redis://r:6379/0\"\n";
        let out = annotate(text, &env);
        assert!(
            out.contains("level = \"info\"  # FENCER__LOG__LEVEL\nformat = \"text\"\n"),
            "{out}"
        );
        assert!(
            out.contains("url = \"redis://r:6379/0\"  # FENCER__BACKEND__REDIS__URL\n"),
            "{out}"
        );
    }

    #[test]
    fn a_sidecar_sees_its_backend_and_not_the_others() {
        let mut s = Settings::default();
        s.backend.kind = Some(BackendKind::Postgres);
        let text = render(&s, Some(Role::Sidecar), &BTreeMap::new()).unwrap();
        assert!(text.contains("[backend.postgres]"), "{text}");
        assert!(!text.contains("[backend.redis]"), "{text}");
        assert!(!text.contains("[inject]"), "{text}");
        assert!(!text.contains("fence_store"), "{text}");
        let parsed: toml::Table = text.parse().unwrap();
        assert!(parsed.contains_key("sidecar"));
    }
}
