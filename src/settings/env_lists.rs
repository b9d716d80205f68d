//! The list-of-tables settings an operator sets per environment:
//! `FENCER__GATEWAY__KEYS`, `FENCER__GATEWAY__ROUTES`, `FENCER__PROXY__ROUTES`.
//!
//! The `config` crate maps `FENCER__A__B=v` onto a scalar or a list of
//! scalars only; `[[gateway.keys]]` and `[[…routes]]` are lists of tables,
//! so without this module they could come from a file alone — and a
//! container whose only configuration is its environment (or a ConfigMap
//! shared by every namespace) could not say which keys to accept or which
//! paths to bind. Each variable takes a short form an operator types
//! (`k1:/etc/fencer/signing/k1,k2:/…`, `/kv/accounts/{id}=account:{id},…`)
//! or, when the value starts with `[`, a JSON array of the same tables as
//! the file (every field, e.g. `key_prefixes`, `var_chars`). A variable that
//! is set **replaces** the file's list, as an environment variable replaces
//! any other value (an empty value empties it). A malformed value is a
//! configuration error naming the variable (exit 2), never ignored.

use std::collections::HashMap;

use serde::de::DeserializeOwned;

use crate::gateway::settings::VerifyKey;
use crate::routes::RouteSpec;
use crate::settings::check::{invalid, ConfigError};
use crate::settings::Settings;

/// `FENCER__GATEWAY__KEYS`: the gateway's accepted signing keys.
pub const GATEWAY_KEYS: &str = "FENCER__GATEWAY__KEYS";
/// `FENCER__GATEWAY__ROUTES`: the gateway's path → key bindings.
pub const GATEWAY_ROUTES: &str = "FENCER__GATEWAY__ROUTES";
/// `FENCER__PROXY__ROUTES`: the egress proxy's path → key map.
pub const PROXY_ROUTES: &str = "FENCER__PROXY__ROUTES";

/// The three variables, as read from the environment (each `None` unless set).
#[derive(Debug, Default)]
pub(crate) struct EnvLists {
    gateway_keys: Option<Vec<VerifyKey>>,
    gateway_routes: Option<Vec<RouteSpec>>,
    proxy_routes: Option<Vec<RouteSpec>>,
}

impl EnvLists {
    /// Takes the three variables out of `env` (so the generic environment
    /// source never sees them: it would try to read a string as a list of
    /// tables) and parses them. Names match case-insensitively, as the
    /// `config` crate matches every other `FENCER__` variable.
    pub(crate) fn take(env: &mut HashMap<String, String>) -> Result<EnvLists, ConfigError> {
        let mut take = |name: &'static str| -> Option<String> {
            let found = env.keys().find(|k| k.eq_ignore_ascii_case(name))?.clone();
            env.remove(&found)
        };
        Ok(EnvLists {
            gateway_keys: take(GATEWAY_KEYS).map(|v| parse_keys(&v)).transpose()?,
            gateway_routes: take(GATEWAY_ROUTES)
                .map(|v| parse_routes(GATEWAY_ROUTES, &v))
                .transpose()?,
            proxy_routes: take(PROXY_ROUTES)
                .map(|v| parse_routes(PROXY_ROUTES, &v))
                .transpose()?,
        })
    }

    /// Replaces the file's lists by the ones the environment set.
    pub(crate) fn apply(self, settings: &mut Settings) {
        if let Some(keys) = self.gateway_keys {
            settings.gateway.keys = keys;
        }
        if let Some(routes) = self.gateway_routes {
            settings.gateway.routes = routes;
        }
        if let Some(routes) = self.proxy_routes {
            settings.proxy.routes = routes;
        }
    }
}

/// `k1:/path/to/k1,k2:/path/to/k2` (each key's secret from a file), or a
/// JSON array of `{"key_id", "secret_file" | "secret_env", "key_prefixes"?}`.
pub(crate) fn parse_keys(value: &str) -> Result<Vec<VerifyKey>, ConfigError> {
    if let Some(list) = json_list(GATEWAY_KEYS, value)? {
        return Ok(list);
    }
    entries(value)
        .enumerate()
        .map(|(i, entry)| match entry.split_once(':') {
            Some((id, path)) if !id.trim().is_empty() && !path.trim().is_empty() => {
                Ok(VerifyKey {
                    key_id: id.trim().to_owned(),
                    secret_file: Some(path.trim().to_owned()),
                    secret_env: None,
                    key_prefixes: Vec::new(),
                })
            }
            _ => Err(invalid(
                GATEWAY_KEYS,
                format!(
                    "entry {} `{entry}` is not KEY_ID:SECRET_FILE (e.g. k1:/etc/fencer/signing/k1,k2:/etc/fencer/signing/k2), and the value is no JSON array",
                    i + 1
                ),
            )),
        })
        .collect()
}

/// `/path/{id}=key:{id},/other=key2`, or a JSON array of
/// `{"path", "key", "var_chars"?}`. The first `=` separates: a path has
/// none, a key template may.
pub(crate) fn parse_routes(var: &'static str, value: &str) -> Result<Vec<RouteSpec>, ConfigError> {
    if let Some(list) = json_list(var, value)? {
        return Ok(list);
    }
    entries(value)
        .enumerate()
        .map(|(i, entry)| match entry.split_once('=') {
            Some((path, key)) if path.trim().starts_with('/') && !key.trim().is_empty() => {
                Ok(RouteSpec {
                    path: path.trim().to_owned(),
                    key: key.trim().to_owned(),
                    var_chars: None,
                })
            }
            _ => Err(invalid(
                var,
                format!(
                    "entry {} `{entry}` is not /PATH=KEY (e.g. /kv/accounts/{{id}}=account:{{id}}), and the value is no JSON array",
                    i + 1
                ),
            )),
        })
        .collect()
}

/// The comma-separated entries of a short form; blank entries (a trailing
/// comma, an empty value) are skipped, so `""` is the empty list.
fn entries(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|e| !e.is_empty())
}

/// A value that starts with `[` is JSON: the same tables as the file, every
/// field checked (unknown ones refused) as in the file.
fn json_list<T: DeserializeOwned>(
    var: &'static str,
    value: &str,
) -> Result<Option<Vec<T>>, ConfigError> {
    if !value.trim_start().starts_with('[') {
        return Ok(None);
    }
    serde_json::from_str(value)
        .map(Some)
        .map_err(|e| invalid(var, format!("not a valid JSON array of tables: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_forms_parse_and_blank_entries_are_skipped() {
        let keys = parse_keys(" k1:/s/k1 , k2:/s/k2,").unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[1].key_id, "k2");
        assert_eq!(keys[1].secret_file.as_deref(), Some("/s/k2"));
        assert!(parse_keys("").unwrap().is_empty());
        let routes = parse_routes(PROXY_ROUTES, "/kv/a/{id}=a:{id},/b=k=v").unwrap();
        assert_eq!(routes[0].key, "a:{id}");
        assert_eq!(routes[1].key, "k=v", "only the first `=` separates");
    }

    #[test]
    fn json_form_takes_every_field_and_refuses_unknown_ones() {
        let keys =
            parse_keys(r#"[{"key_id":"k1","secret_env":"S","key_prefixes":["a/"]}]"#).unwrap();
        assert_eq!(keys[0].secret_env.as_deref(), Some("S"));
        assert_eq!(keys[0].key_prefixes, ["a/"]);
        let routes = parse_routes(
            GATEWAY_ROUTES,
            r#"[{"path":"/x/{n}","key":"x:{n}","var_chars":"0-9"}]"#,
        )
        .unwrap();
        assert_eq!(routes[0].var_chars.as_deref(), Some("0-9"));
        let e = parse_keys(r#"[{"key_id":"k1","secret_fil":"/x"}]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains(GATEWAY_KEYS) && e.contains("secret_fil"), "{e}");
    }

    #[test]
    fn malformed_entries_name_the_variable_and_the_entry() {
        for (var, value, entry) in [
            (GATEWAY_KEYS, "k1:/a,k2", "entry 2 `k2`"),
            (GATEWAY_KEYS, ":/a", "entry 1"),
            (GATEWAY_ROUTES, "/a=b,c=d", "entry 2 `c=d`"),
            (PROXY_ROUTES, "/a", "entry 1 `/a`"),
        ] {
            let e = if var == GATEWAY_KEYS {
                parse_keys(value).unwrap_err()
            } else {
                parse_routes(var, value).unwrap_err()
            }
            .to_string();
            assert!(e.contains(var) && e.contains(entry), "{value}: {e}");
        }
    }

    #[test]
    fn take_removes_the_variables_and_matches_any_case() {
        let mut env: HashMap<String, String> = [
            ("fencer__gateway__routes", "/a=b"),
            ("FENCER__GATEWAY__KEYS", "k1:/x"),
            ("FENCER__LOG__LEVEL", "debug"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let lists = EnvLists::take(&mut env).unwrap();
        assert_eq!(env.len(), 1, "{env:?}");
        let mut s = Settings::default();
        s.proxy.routes = vec![RouteSpec {
            path: "/file".into(),
            key: "file".into(),
            var_chars: None,
        }];
        lists.apply(&mut s);
        assert_eq!(s.gateway.routes[0].key, "b");
        assert_eq!(s.gateway.keys[0].key_id, "k1");
        assert_eq!(
            s.proxy.routes[0].key, "file",
            "an unset variable keeps the file's list"
        );
    }
}
