//! Parsing and validating lock API request bodies.
//!
//! Bodies are parsed by hand from a JSON object rather than by serde derive,
//! so that every rejection names its field and the allowed range
//! (`ttl_ms must be an integer between 100 and 3600000`), which is what a
//! developer in another language needs to fix the call.

use std::time::Duration;

use serde_json::{Map, Value};

use super::leases::Renewal;
use crate::error::ApiError;
use crate::lock::{LeaseId, LockKey};
use crate::settings::limits::*;

pub struct AcquireRequest {
    pub ttl: Duration,
    pub wait: Duration,
    pub owner: Option<String>,
    pub renewal: Renewal,
    /// `"reentrant": true`: the owner may take the key again while its
    /// lease holds it (a hold count, kept with the lease in the backend).
    pub reentrant: bool,
    /// `"mode": "read"`: a read lease of a read-write lock, shared with
    /// other readers (default `write`: the exclusive lease).
    pub mode: crate::token::Mode,
}

impl AcquireRequest {
    /// The lock manager's request for `key`.
    pub fn into_acquire(self, key: LockKey) -> super::locks::Acquire {
        super::locks::Acquire {
            key,
            ttl: self.ttl,
            wait: self.wait,
            owner: self.owner,
            renewal: self.renewal,
            dapr_store: None,
            reentrant: self.reentrant,
        }
    }
}

/// Values used when a request leaves them out (from the configuration).
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    pub ttl_ms: u64,
    pub wait_ms: u64,
    pub keepalive_ms: u64,
}

pub struct LeaseRequest {
    pub lease_id: LeaseId,
    pub ttl: Option<Duration>,
}

pub fn key(raw: &str) -> Result<LockKey, ApiError> {
    LockKey::parse(raw).map_err(|e| ApiError::invalid("key", e.to_string()))
}

/// The body as a JSON object; an empty body is `{}`.
pub fn object(body: &[u8], allowed: &[&str]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("body is not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(ApiError::invalid("body", "body must be a JSON object"));
    };
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            unknown,
            format!(
                "unknown field `{unknown}`; allowed fields: {}",
                allowed.join(", ")
            ),
        ));
    }
    Ok(map)
}

fn millis(
    map: &Map<String, Value>,
    field: &str,
    min: u64,
    max: u64,
) -> Result<Option<Duration>, ApiError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Ok(Some(Duration::from_millis(n))),
            _ => Err(ApiError::invalid(
                field,
                format!("`{field}` must be an integer between {min} and {max} (milliseconds)"),
            )),
        },
    }
}

/// Acquire and hold bodies: `ttl_ms`, `wait_ms`, `owner`, and for acquire
/// `auto_renew` with an optional `keepalive_ms`.
pub fn acquire(body: &[u8], defaults: &Defaults, hold: bool) -> Result<AcquireRequest, ApiError> {
    let allowed: &[&str] = if hold {
        &["ttl_ms", "wait_ms", "owner", "mode"]
    } else {
        &[
            "ttl_ms",
            "wait_ms",
            "owner",
            "auto_renew",
            "keepalive_ms",
            "reentrant",
            "mode",
        ]
    };
    let map = object(body, allowed)?;
    let mut req = acquire_fields(&map, defaults, hold)?;
    req.mode = match map.get("mode") {
        None | Some(Value::Null) => crate::token::Mode::Write,
        Some(Value::String(m)) if m == "write" => crate::token::Mode::Write,
        Some(Value::String(m)) if m == "read" => crate::token::Mode::Read,
        Some(_) => {
            return Err(ApiError::invalid(
                "mode",
                "`mode` must be \"read\" (shared with other readers) or \"write\" (exclusive)",
            ))
        }
    };
    if req.mode == crate::token::Mode::Read && req.reentrant {
        return Err(ApiError::invalid(
            "mode",
            "a read lease is not reentrant: readers share the key already, so take another read lease",
        ));
    }
    Ok(req)
}

/// A semaphore's acquire (`hold`: its hold stream) body: `permits`, and
/// the fields of a lock's, except `reentrant`.
pub fn permit(
    body: &[u8],
    defaults: &Defaults,
    hold: bool,
) -> Result<(u32, AcquireRequest), ApiError> {
    use super::locks::MAX_PERMITS;
    let allowed: &[&str] = if hold {
        &["permits", "ttl_ms", "wait_ms", "owner"]
    } else {
        &[
            "permits",
            "ttl_ms",
            "wait_ms",
            "owner",
            "auto_renew",
            "keepalive_ms",
        ]
    };
    let map = object(body, allowed)?;
    let permits = map
        .get("permits")
        .and_then(Value::as_u64)
        .filter(|n| (1..=u64::from(MAX_PERMITS)).contains(n))
        .ok_or_else(|| {
            ApiError::invalid(
                "permits",
                format!("`permits` is required: an integer between 1 and {MAX_PERMITS}, the same for every user of the name"),
            )
        })?;
    Ok((permits as u32, acquire_fields(&map, defaults, hold)?))
}

/// A multi-key acquire's body: `keys` (1 to `MAX_KEYS` lock keys) and
/// the fields of a lock's, except `reentrant`.
pub fn multi(body: &[u8], defaults: &Defaults) -> Result<(Vec<LockKey>, AcquireRequest), ApiError> {
    use super::locks::MAX_KEYS;
    let map = object(
        body,
        &[
            "keys",
            "ttl_ms",
            "wait_ms",
            "owner",
            "auto_renew",
            "keepalive_ms",
        ],
    )?;
    let bad = || {
        ApiError::invalid(
            "keys",
            format!("`keys` is required: an array of 1 to {MAX_KEYS} lock keys (strings of 1-512 bytes, no control characters)"),
        )
    };
    let Some(Value::Array(raw)) = map.get("keys") else {
        return Err(bad());
    };
    if raw.is_empty() || raw.len() > MAX_KEYS {
        return Err(bad());
    }
    let keys = raw
        .iter()
        .map(|v| {
            let raw = v.as_str().ok_or_else(bad)?;
            LockKey::parse(raw).map_err(|e| ApiError::invalid("keys", format!("`keys`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((keys, acquire_fields(&map, defaults, false)?))
}

fn acquire_fields(
    map: &Map<String, Value>,
    defaults: &Defaults,
    hold: bool,
) -> Result<AcquireRequest, ApiError> {
    let ttl = millis(map, "ttl_ms", MIN_TTL_MS, MAX_TTL_MS)?
        .unwrap_or(Duration::from_millis(defaults.ttl_ms));
    let wait =
        millis(map, "wait_ms", 0, MAX_WAIT_MS)?.unwrap_or(Duration::from_millis(defaults.wait_ms));
    let auto = match map.get("auto_renew") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "auto_renew",
                "`auto_renew` must be true or false",
            ))
        }
    };
    let keepalive = millis(map, "keepalive_ms", MIN_TTL_MS, MAX_TTL_MS)?;
    if keepalive.is_some() && !auto {
        return Err(ApiError::invalid(
            "keepalive_ms",
            "`keepalive_ms` only applies with \"auto_renew\": true",
        ));
    }
    let renewal = if hold {
        Renewal::Hold
    } else if auto {
        Renewal::Auto {
            keepalive: keepalive.unwrap_or(Duration::from_millis(defaults.keepalive_ms)),
        }
    } else {
        Renewal::Manual
    };
    let owner = match map.get("owner") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.len() <= MAX_OWNER_BYTES && !s.chars().any(char::is_control) => {
            Some(s.clone())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "owner",
                format!("`owner` must be a string of at most {MAX_OWNER_BYTES} bytes without control characters"),
            ))
        }
    };
    let reentrant = match map.get("reentrant") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "reentrant",
                "`reentrant` must be true or false",
            ))
        }
    };
    if reentrant && owner.is_none() {
        return Err(ApiError::invalid(
            "owner",
            "a reentrant acquire needs an `owner`: the one that may take the key again",
        ));
    }
    Ok(AcquireRequest {
        ttl,
        wait,
        owner,
        renewal,
        reentrant,
        mode: crate::token::Mode::Write,
    })
}

/// Renew (`lease_id`, optional `ttl_ms`) and release (`lease_id`) bodies.
pub fn lease(body: &[u8], with_ttl: bool) -> Result<LeaseRequest, ApiError> {
    let allowed: &[&str] = if with_ttl {
        &["lease_id", "ttl_ms"]
    } else {
        &["lease_id"]
    };
    let map = object(body, allowed)?;
    let lease_id = lease_id(&map)?;
    let ttl = if with_ttl { ttl(&map)? } else { None };
    Ok(LeaseRequest { lease_id, ttl })
}

/// The required `lease_id` of a lease body.
pub fn lease_id(map: &Map<String, Value>) -> Result<LeaseId, ApiError> {
    match map.get("lease_id") {
        Some(Value::String(s)) => LeaseId::parse(s),
        _ => None,
    }
    .ok_or_else(|| {
        ApiError::invalid(
            "lease_id",
            "`lease_id` is required: the string returned by acquire (1-64 characters of A-Z a-z 0-9 _ -)",
        )
    })
}

/// A renewal's optional `ttl_ms`.
pub fn ttl(map: &Map<String, Value>) -> Result<Option<Duration>, ApiError> {
    millis(map, "ttl_ms", MIN_TTL_MS, MAX_TTL_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Defaults = Defaults {
        ttl_ms: 1000,
        wait_ms: 0,
        keepalive_ms: 5000,
    };

    #[test]
    fn auto_renew_and_keepalive() {
        let r = acquire(br#"{"auto_renew":true,"keepalive_ms":2000}"#, &D, false).unwrap();
        assert_eq!(
            r.renewal,
            Renewal::Auto {
                keepalive: Duration::from_millis(2000)
            }
        );
        let r = acquire(br#"{"auto_renew":true}"#, &D, false).unwrap();
        assert_eq!(
            r.renewal,
            Renewal::Auto {
                keepalive: Duration::from_millis(5000)
            }
        );
        assert_eq!(
            field(
                acquire(br#"{"keepalive_ms":2000}"#, &D, false)
                    .err()
                    .unwrap()
            ),
            "keepalive_ms"
        );
        assert_eq!(
            field(
                acquire(br#"{"auto_renew":"yes"}"#, &D, false)
                    .err()
                    .unwrap()
            ),
            "auto_renew"
        );
        assert_eq!(
            field(acquire(br#"{"auto_renew":true}"#, &D, true).err().unwrap()),
            "auto_renew"
        );
        assert_eq!(acquire(b"{}", &D, true).unwrap().renewal, Renewal::Hold);
    }

    fn field(err: ApiError) -> String {
        err.extra["field"].as_str().unwrap().to_owned()
    }

    #[test]
    fn acquire_defaults_and_bounds() {
        let r = acquire(b"", &D, false).unwrap();
        assert_eq!(r.ttl, Duration::from_millis(1000));
        let r = acquire(
            br#"{"ttl_ms":100,"wait_ms":300000,"owner":"w1"}"#,
            &D,
            false,
        )
        .unwrap();
        assert_eq!(r.wait, Duration::from_millis(300_000));
        for (body, f) in [
            (&br#"{"ttl_ms":0}"#[..], "ttl_ms"),
            (br#"{"ttl_ms":-1}"#, "ttl_ms"),
            (br#"{"ttl_ms":1.5}"#, "ttl_ms"),
            (br#"{"ttl_ms":3600001}"#, "ttl_ms"),
            (br#"{"wait_ms":300001}"#, "wait_ms"),
            (br#"{"ttl_ms":"100"}"#, "ttl_ms"),
            (br#"{"nope":1}"#, "nope"),
            (br#"[1]"#, "body"),
            (b"not json", "body"),
        ] {
            let err = acquire(body, &D, false).err().expect("must fail");
            assert_eq!(field(err), f, "{}", String::from_utf8_lossy(body));
        }
        let long_owner = format!(r#"{{"owner":"{}"}}"#, "o".repeat(257));
        assert_eq!(
            field(acquire(long_owner.as_bytes(), &D, false).err().unwrap()),
            "owner"
        );
    }

    #[test]
    fn lease_bodies() {
        assert!(lease(br#"{"lease_id":"abc"}"#, false).is_ok());
        assert_eq!(field(lease(br#"{}"#, false).err().unwrap()), "lease_id");
        assert_eq!(
            field(lease(br#"{"lease_id":"a b"}"#, false).err().unwrap()),
            "lease_id"
        );
        assert_eq!(
            field(
                lease(br#"{"lease_id":"a","ttl_ms":5}"#, false)
                    .err()
                    .unwrap()
            ),
            "ttl_ms"
        );
        assert_eq!(
            field(
                lease(br#"{"lease_id":"a","ttl_ms":5}"#, true)
                    .err()
                    .unwrap()
            ),
            "ttl_ms"
        );
    }
}
