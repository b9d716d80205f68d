//! Path patterns that name a lock key: `/accounts/{id}` → `account:{id}`.
//!
//! Used by the egress proxy (to find the lock a request needs when the
//! application does not send `Fencing-Lock`) and by the gateway (to bind a
//! path to the only key whose token may write it, so a token for one
//! resource cannot authorise writes to another). Both match the path in its
//! normal form ([`path::normalize`]), never the raw request target.

pub mod path;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// Path pattern; `{name}` matches one path segment.
    pub path: String,
    /// Key template using the same `{name}` variables.
    pub key: String,
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
            routes.push(Route { segments, key });
        }
        Ok(Routes(routes))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The key named by `path` (without query, in normal form), if a route
    /// matches.
    pub fn key_for(&self, path: &str) -> Option<String> {
        let parts: Vec<&str> = path.strip_prefix('/')?.split('/').collect();
        'routes: for route in &self.0 {
            if route.segments.len() != parts.len() {
                continue;
            }
            let mut vars: Vec<(&str, String)> = Vec::new();
            for (seg, part) in route.segments.iter().zip(&parts) {
                match seg {
                    Segment::Literal(l) if l == part => {}
                    Segment::Literal(_) => continue 'routes,
                    Segment::Var(name) => {
                        if part.is_empty() {
                            continue 'routes;
                        }
                        let decoded = percent_encoding::percent_decode_str(part)
                            .decode_utf8()
                            .ok()?
                            .into_owned();
                        vars.push((name.as_str(), decoded));
                    }
                }
            }
            let mut key = String::new();
            for k in &route.key {
                match k {
                    Segment::Literal(l) => key.push_str(l),
                    Segment::Var(name) => {
                        let v = vars.iter().find(|(n, _)| n == name)?;
                        key.push_str(&v.1);
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
        assert_eq!(r.key_for("/accounts/a%20b").as_deref(), Some("account:a b"));
        assert_eq!(r.key_for("/kv/x/y").as_deref(), Some("kv:y:x"));
        assert_eq!(r.key_for("/accounts/42/extra"), None);
        assert_eq!(r.key_for("/accounts/"), None);
        assert_eq!(r.key_for("/other"), None);
    }

    #[test]
    fn rejects_bad_specs() {
        let bad = |p: &str, k: &str| {
            Routes::compile(&[RouteSpec {
                path: p.into(),
                key: k.into(),
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
    }
}
