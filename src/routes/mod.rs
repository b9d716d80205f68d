//! Path patterns that name a lock key: `/accounts/{id}` → `account:{id}`.
//!
//! Used by the egress proxy (to find the lock a request needs when the
//! application does not send `Fencing-Lock`) and by the gateway (to bind a
//! path to the only key whose token may write it, so a token for one
//! resource cannot authorise writes to another). Both match the path in its
//! normal form ([`path::normalize`]), never the raw request target.
//!
//! A `{name}` matches only a segment made of the route's variable
//! characters ([`VarChars`]; by default `A-Z a-z 0-9 - _`), never an
//! escape, a `.`, a `;` or a non-ASCII character. Binding a path to one key
//! is only as good as the storage reading that path as one object: servlet
//! storages read `/accounts/2;x` as `/accounts/2`, Spring's suffix matching
//! reads `/accounts/2.json` as `/accounts/2`, and a storage that folds
//! Unicode reads a full-width `２` as `2` — each a second lock key for one
//! object, so a token for `account:2;x` could write over a newer holder of
//! `account:2` (issue 26 item 8). A path whose segment holds any other
//! character matches no route, and the gateway refuses a fenced request to
//! it (`path_not_routed`).

pub mod path;
mod var_chars;

use serde::{Deserialize, Serialize};

pub use var_chars::VarChars;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// Path pattern; `{name}` matches one path segment.
    pub path: String,
    /// Key template using the same `{name}` variables.
    pub key: String,
    /// The characters a `{name}` segment may hold, as a character class
    /// without brackets (`"0-9"`, `"A-Za-z0-9._~-"`); only ASCII letters,
    /// digits and `-._~` may be listed. Default `A-Za-z0-9_-`.
    #[serde(default)]
    pub var_chars: Option<String>,
}

#[derive(Debug, Clone)]
enum Segment {
    Literal(String),
    Var(String),
}

#[derive(Debug, Clone)]
struct Route {
    segments: Vec<Segment>,
    key: Vec<Segment>,
    var_chars: VarChars,
}

/// A compiled, ordered list of routes; the first match wins.
#[derive(Debug, Clone, Default)]
pub struct Routes(Vec<Route>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("route `{path}`: {reason}")]
pub struct RouteError {
    pub path: String,
    pub reason: String,
}

fn parse_template(t: &str) -> Result<Vec<Segment>, String> {
    let mut out = Vec::new();
    let mut rest = t;
    while !rest.is_empty() {
        if let Some(start) = rest.find('{') {
            if start > 0 {
                out.push(Segment::Literal(rest[..start].to_owned()));
            }
            let end = rest[start..]
                .find('}')
                .ok_or_else(|| format!("unclosed `{{` in `{t}`"))?;
            let name = &rest[start + 1..start + end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!("bad variable name `{name}` in `{t}`"));
            }
            out.push(Segment::Var(name.to_owned()));
            rest = &rest[start + end + 1..];
        } else {
            out.push(Segment::Literal(rest.to_owned()));
            break;
        }
    }
    Ok(out)
}

impl Routes {
    pub fn compile(specs: &[RouteSpec]) -> Result<Routes, RouteError> {
        let mut routes = Vec::new();
        for spec in specs {
            let err = |reason: String| RouteError {
                path: spec.path.clone(),
                reason,
            };
            if !spec.path.starts_with('/') {
                return Err(err("path must start with `/`".into()));
            }
            if spec.path.contains(';') {
                return Err(err(
                    "path must not contain `;`: the gateway refuses fenced requests with path parameters".into(),
                ));
            }
            let var_chars = match &spec.var_chars {
                None => VarChars::default(),
                Some(class) => {
                    VarChars::parse(class).map_err(|e| err(format!("var_chars: {e}")))?
                }
            };
            if path::normalize(&spec.path).as_deref() != Ok(spec.path.as_str()) {
                return Err(err(
                    "path must be in normal form: no empty, `.` or `..` segments, no trailing `/`, no percent-escapes of unreserved characters".into(),
                ));
            }
            let mut segments = Vec::new();
            for seg in spec.path[1..].split('/') {
                let parsed = parse_template(seg).map_err(err)?;
                match parsed.as_slice() {
                    [] => segments.push(Segment::Literal(String::new())),
                    [Segment::Var(name)]
                        if segments
                            .iter()
                            .any(|s| matches!(s, Segment::Var(n) if n == name)) =>
                    {
                        // Two segments, one variable: which one names the
                        // key would be a guess.
                        return Err(err(format!(
                            "variable `{{{name}}}` appears twice in the path"
                        )));
                    }
                    [one] => segments.push(one.clone()),
                    _ => {
                        return Err(err(
                            "a variable must be a whole path segment (`/a/{id}`, not `/a/x{id}`)"
                                .into(),
                        ))
                    }
                }
            }
            let key = parse_template(&spec.key).map_err(err)?;
            for k in &key {
                if let Segment::Var(name) = k {
                    if !segments
                        .iter()
                        .any(|s| matches!(s, Segment::Var(n) if n == name))
                    {
                        return Err(err(format!(
                            "key uses `{{{name}}}`, which the path does not capture"
                        )));
                    }
                }
            }
            if key.is_empty() {
                return Err(err("key template must not be empty".into()));
            }
            routes.push(Route {
                segments,
                key,
                var_chars,
            });
        }
        Ok(Routes(routes))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The key named by `path` (without query, in normal form), if a route
    /// matches: every literal segment equal, every variable segment made of
    /// the route's variable characters only (so it needs no decoding, and
    /// its value is exactly what the storage sees).
    pub fn key_for(&self, path: &str) -> Option<String> {
        let parts: Vec<&str> = path.strip_prefix('/')?.split('/').collect();
        'routes: for route in &self.0 {
            if route.segments.len() != parts.len() {
                continue;
            }
            let mut vars: Vec<(&str, &str)> = Vec::new();
            for (seg, part) in route.segments.iter().zip(&parts) {
                match seg {
                    Segment::Literal(l) if l == part => {}
                    Segment::Literal(_) => continue 'routes,
                    Segment::Var(name) => {
                        if !route.var_chars.matches(part) {
                            continue 'routes;
                        }
                        vars.push((name.as_str(), part));
                    }
                }
            }
            let mut key = String::new();
            for k in &route.key {
                match k {
                    Segment::Literal(l) => key.push_str(l),
                    Segment::Var(name) => {
                        let v = vars.iter().find(|(n, _)| n == name)?;
                        key.push_str(v.1);
                    }
                }
            }
            return Some(key);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(specs: &[(&str, &str)]) -> Routes {
        Routes::compile(
            &specs
                .iter()
                .map(|(p, k)| RouteSpec {
                    path: (*p).into(),
                    key: (*k).into(),
                    var_chars: None,
                })
                .collect::<Vec<_>>(),
        )
        .unwrap()
    }

    #[test]
    fn maps_paths_to_keys() {
        let r = routes(&[
            ("/accounts/{id}", "account:{id}"),
            ("/kv/{a}/{b}", "kv:{b}:{a}"),
        ]);
        assert_eq!(r.key_for("/accounts/42").as_deref(), Some("account:42"));
        assert_eq!(
            r.key_for("/accounts/a-b_C").as_deref(),
            Some("account:a-b_C")
        );
        assert_eq!(r.key_for("/kv/x/y").as_deref(), Some("kv:y:x"));
        assert_eq!(r.key_for("/accounts/42/extra"), None);
        assert_eq!(r.key_for("/accounts/"), None);
        assert_eq!(r.key_for("/other"), None);
    }

    /// Issue 26 item 8: one storage object, several lock keys. Each of
    /// these paths is `/accounts/2` (or another path) to some storage.
    #[test]
    fn variables_match_only_their_characters() {
        let r = routes(&[("/accounts/{id}", "account:{id}")]);
        for p in [
            "/accounts/2;x",
            "/accounts/2%3B",
            "/accounts/2.json",
            "/accounts/%EF%BC%92",
            "/accounts/２",
            "/accounts/a%20b",
            "/accounts/a~",
            "/accounts/%2e",
        ] {
            assert_eq!(r.key_for(p), None, "{p}");
        }
        let wide = Routes::compile(&[RouteSpec {
            path: "/files/{name}".into(),
            key: "file:{name}".into(),
            var_chars: Some("A-Za-z0-9._~-".into()),
        }])
        .unwrap();
        assert_eq!(wide.key_for("/files/a.b~c").as_deref(), Some("file:a.b~c"));
        assert_eq!(wide.key_for("/files/a;b"), None);
    }

    #[test]
    fn rejects_bad_specs() {
        let bad = |p: &str, k: &str| {
            Routes::compile(&[RouteSpec {
                path: p.into(),
                key: k.into(),
                var_chars: None,
            }])
            .is_err()
        };
        assert!(bad("accounts/{id}", "a:{id}"));
        assert!(bad("/accounts/{id}", "a:{nope}"));
        assert!(bad("/accounts/x{id}", "a:{id}"));
        assert!(bad("/accounts/{id", "a:{id}"));
        assert!(bad("/accounts/{id}", ""));
        assert!(bad("/accounts/{id}/", "a:{id}"));
        assert!(bad("/a//{id}", "a:{id}"));
        assert!(bad("/a/../{id}", "a:{id}"));
        assert!(bad("/a;v=1/{id}", "a:{id}"));
        assert!(bad("/a/{id}/b/{id}", "a:{id}"));
        let chars = |c: &str| {
            Routes::compile(&[RouteSpec {
                path: "/a/{id}".into(),
                key: "a:{id}".into(),
                var_chars: Some(c.into()),
            }])
            .is_err()
        };
        assert!(chars("0-9;"));
        assert!(chars(""));
        assert!(!chars("0-9"));
    }
}
