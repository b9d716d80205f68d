//! One normal form for request paths, used by the egress proxy and the
//! gateway alike.
//!
//! The gateway binds a path to the one key whose token may write it. That
//! binding is only as good as the agreement between the gateway's reading of
//! a path and the storage's: `/kv/accounts%2F2`, `/kv/%61ccounts/2`,
//! `/kv/accounts/2/`, `/kv//accounts/2` and `/kv/accounts/1/../2` all match
//! no route (or another one) at the gateway, yet many storages read them as
//! `/kv/accounts/2` (issue 9 item 10). So a fenced request's path is put in
//! one normal form, checked in that form, and forwarded in that form:
//!
//! - percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are
//!   decoded, every other escape is kept with upper-case hex;
//! - every other character (UTF-8 included) is kept as it is;
//! - an encoded `/` or `\`, a raw `\`, a `.` or `..` segment (encoded or
//!   not), an empty segment (`//`, a trailing `/`) and a malformed escape
//!   are refused — they have no one meaning;
//! - a `;` (raw or `%3B`) is refused: servlet-style storages (Tomcat, Jetty,
//!   Spring) read what follows it as path parameters and drop them, so
//!   `/kv/accounts/2;x` is `/kv/accounts/2` to them and another path to
//!   everyone else (issue 26 item 8). Spring Security's firewall refuses
//!   both spellings for the same reason.
//!
//! The query string is not part of the path and is forwarded unchanged.

use std::fmt::Write as _;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path must start with `/`")]
    NotAbsolute,
    #[error("empty path segment (`//` or a trailing `/`)")]
    EmptySegment,
    #[error("`.` or `..` path segment")]
    DotSegment,
    #[error("encoded `/` or `\\` (or a raw `\\`) in a path segment")]
    EncodedSeparator,
    #[error("malformed percent-encoding")]
    BadEscape,
    #[error("`;` path parameters (or an encoded `;`)")]
    Parameters,
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// `uri` with its path in normal form (query kept), or why it has none.
pub fn normalize_uri(uri: &hyper::Uri) -> Result<hyper::Uri, PathError> {
    let normal = normalize(uri.path())?;
    if normal == uri.path() {
        return Ok(uri.clone());
    }
    let pq = match uri.query() {
        Some(q) => format!("{normal}?{q}"),
        None => normal,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(pq.parse().map_err(|_| PathError::BadEscape)?);
    hyper::Uri::from_parts(parts).map_err(|_| PathError::BadEscape)
}

/// The normal form of `path` (without its query), or why it has none.
/// `/` alone is normal.
pub fn normalize(path: &str) -> Result<String, PathError> {
    let rest = path.strip_prefix('/').ok_or(PathError::NotAbsolute)?;
    if rest.is_empty() {
        return Ok("/".to_owned());
    }
    let mut out = String::with_capacity(path.len());
    for segment in rest.split('/') {
        if segment.is_empty() {
            return Err(PathError::EmptySegment);
        }
        out.push('/');
        let start = out.len();
        let bytes = segment.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'%' => {
                    let (Some(hi), Some(lo)) = (
                        bytes.get(i + 1).copied().and_then(hex),
                        bytes.get(i + 2).copied().and_then(hex),
                    ) else {
                        return Err(PathError::BadEscape);
                    };
                    let b = hi << 4 | lo;
                    if b == b'/' || b == b'\\' {
                        return Err(PathError::EncodedSeparator);
                    }
                    if b == b';' {
                        return Err(PathError::Parameters);
                    }
                    if unreserved(b) {
                        out.push(b as char);
                    } else {
                        let _ = write!(out, "%{b:02X}");
                    }
                    i += 3;
                }
                b'\\' => return Err(PathError::EncodedSeparator),
                b';' => return Err(PathError::Parameters),
                _ => {
                    // hyper has already refused anything that is not a
                    // valid request-target byte; keep the rest as it is,
                    // copied as text up to the next `%` or `\`. Pushing each
                    // byte as a `char` turned every byte of a non-ASCII
                    // character (hyper accepts UTF-8 in paths) into one of
                    // its own: `/é` became `/Ã©`, another path, and not
                    // idempotent (found by fuzzing,
                    // `fuzz/regressions/path_normalize`).
                    let end = bytes[i..]
                        .iter()
                        .position(|&b| matches!(b, b'%' | b'\\' | b';'))
                        .map_or(bytes.len(), |n| i + n);
                    out.push_str(&segment[i..end]);
                    i = end;
                }
            }
        }
        if matches!(&out[start..], "." | "..") {
            return Err(PathError::DotSegment);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_paths_are_unchanged() {
        for p in [
            "/",
            "/kv/accounts/1",
            "/a/b-c_d.e~f",
            "/kv/a%20b",
            "/x/%C3%A9",
            "/x/é/🍕",
        ] {
            assert_eq!(normalize(p).as_deref(), Ok(p), "{p}");
        }
    }

    #[test]
    fn unreserved_escapes_are_decoded_others_upper_cased() {
        assert_eq!(
            normalize("/kv/%61ccounts/2").as_deref(),
            Ok("/kv/accounts/2")
        );
        assert_eq!(normalize("/kv/a%2fb%7e"), Err(PathError::EncodedSeparator));
        assert_eq!(normalize("/kv/a%7e%3a").as_deref(), Ok("/kv/a~%3A"));
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        use PathError::*;
        for (p, e) in [
            ("/kv/accounts%2F2", EncodedSeparator),
            ("/kv/accounts%5C2", EncodedSeparator),
            ("/kv/accounts\\2", EncodedSeparator),
            ("/kv/accounts/2/", EmptySegment),
            ("/kv//accounts/2", EmptySegment),
            ("/kv/accounts/1/../2", DotSegment),
            ("/kv/./accounts/2", DotSegment),
            ("/kv/%2e%2E/x", DotSegment),
            ("/kv/%2e/x", DotSegment),
            ("/kv/%zz", BadEscape),
            ("/kv/%4", BadEscape),
            ("/kv/accounts/2;x", Parameters),
            ("/kv/accounts;v=1/2", Parameters),
            ("/kv/accounts/2%3bx", Parameters),
            ("/kv/accounts/2%3B", Parameters),
            ("kv", NotAbsolute),
        ] {
            assert_eq!(normalize(p), Err(e), "{p}");
        }
        // Dots inside a segment are ordinary characters.
        assert_eq!(normalize("/kv/a..b").as_deref(), Ok("/kv/a..b"));
    }

    #[test]
    fn uris_keep_their_query() {
        let uri: hyper::Uri = "/kv/%61/b?x=%2F&y".parse().unwrap();
        assert_eq!(normalize_uri(&uri).unwrap().to_string(), "/kv/a/b?x=%2F&y");
        let abs: hyper::Uri = "http://h:1/kv/%61".parse().unwrap();
        assert_eq!(normalize_uri(&abs).unwrap().to_string(), "http://h:1/kv/a");
    }
}
