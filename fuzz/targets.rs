//! The bodies of fencer's fuzz targets, as plain functions.
//!
//! Each `fuzz_targets/<name>.rs` is a thin `fuzz_target!` around the
//! function of the same name here, and the main crate's
//! `tests/fuzz_corpus.rs` includes this file (`#[path]`) to replay the
//! committed corpora on stable Rust without libFuzzer. So this file uses only
//! std, `fencer`, `serde_json` and `hyper` (all dependencies of the main
//! crate already).
//!
//! Every target asserts properties the code documents, not only "does not
//! panic": a failed assertion is a finding like a panic is.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fencer::lock::{LeaseId, LockKey};
use fencer::routes::path::{normalize, normalize_uri, PathError};
use fencer::routes::{RouteSpec, Routes};
use fencer::settings::limits::{
    MAX_KEY_BYTES, MAX_OWNER_BYTES, MAX_TTL_MS, MAX_WAIT_MS, MIN_TTL_MS,
};
use fencer::settings::{ConfigError, Settings};
use fencer::sidecar::leases::Renewal;
use fencer::sidecar::request::{self, Defaults};
use fencer::token::{lease_tag, parse_unverified, Claim, Keyring, Signer, TokenError};
use serde_json::{Map, Value};

// ---------------------------------------------------------------------------
// Small helpers shared by the targets.

/// A deterministic stream of pseudo-random numbers seeded by the input, for
/// choices the input's text should not have to spell out.
struct Rng(u64);

impl Rng {
    fn new(data: &[u8]) -> Rng {
        // FNV-1a over the input, then xorshift.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in data {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Rng(h | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn bit(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The bytes a path stands for: every valid `%XX` decoded, anything else
/// kept as it is.
fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(hi), Some(lo)) = (hex_value(b[i + 1]), hex_value(b[i + 2])) {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

/// Key ids as the configuration accepts them: 1–32 of `[A-Za-z0-9_-]`.
fn valid_key_id(kid: &str) -> bool {
    !kid.is_empty()
        && kid.len() <= 32
        && kid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

// ---------------------------------------------------------------------------
// Tokens.

/// The secret of key id `k1` in the token targets (and the seed tokens).
pub const SECRET_K1: &[u8; 32] = b"fencer-fuzz-secret-k1-0123456789";
/// The secret of key id `k2`, which may sign only `team-a/` keys.
pub const SECRET_K2: &[u8; 32] = b"fencer-fuzz-secret-k2-0123456789";

fn keyring() -> Keyring {
    Keyring::with_prefixes(&[
        ("k1".into(), SECRET_K1.to_vec(), Vec::new()),
        ("k2".into(), SECRET_K2.to_vec(), vec!["team-a/".into()]),
    ])
}

/// `token_verify`: an arbitrary wire string against `Signer::verify`,
/// `Keyring::verify` and `parse_unverified`.
///
/// - a token that verifies is in the one form the signer writes: re-signing
///   its claim gives the same string back (v2), so no two strings carry the
///   same signed claim (the SQL verifier, which signs the token's text as it
///   stands, then agrees with the gateway); a v1 token's lease id is reduced
///   to its tag;
/// - `parse_unverified` reads the same claim from every token that verifies;
/// - a keyring answers as the signer of the token's key id, and refuses a
///   key outside that signer's prefixes with `KeyNotAllowed`, an unknown key
///   id with `UnknownKeyId`.
pub fn token_verify(data: &[u8]) {
    let wire = String::from_utf8_lossy(data);
    let wire = wire.as_ref();
    let parts: Vec<&str> = wire.split('.').collect();
    let k1 = Signer::new("k1", SECRET_K1);
    let k2 = Signer::new("k2", SECRET_K2);
    let verified = k1.verify(wire);

    if let Ok(claim) = &verified {
        assert_eq!(parts.len(), 6, "{wire:?}");
        let resigned = k1.sign(claim);
        match parts[0] {
            "v2" => assert_eq!(resigned, wire, "a verified v2 token is canonical"),
            "v1" => {
                assert_eq!(claim.lease, lease_tag(parts[3]), "v1 lease id -> tag");
                let r: Vec<&str> = resigned.split('.').collect();
                assert_eq!(
                    (r[1], r[2], r[4]),
                    (parts[1], parts[2], parts[4]),
                    "{wire:?}"
                );
            }
            v => panic!("verified a token of version {v:?}"),
        }
        assert_eq!(k1.verify(&resigned).as_ref(), Ok(claim));
        let raw = parse_unverified(wire).expect("a verified token parses");
        assert_eq!((&raw.key, raw.token), (&claim.key, claim.token));
        if parts[0] == "v2" {
            assert_eq!(&raw, claim);
        }
    }
    if let Err(TokenError::UnknownKeyId) = verified {
        assert_ne!(parts.get(1), Some(&"k1"));
    }

    let expected = match parts.get(1) {
        None => Err(TokenError::Malformed),
        Some(&"k1") => k1.verify(wire),
        Some(&"k2") => match k2.verify(wire) {
            Ok(c) if c.key.starts_with("team-a/") => Ok(c),
            Ok(c) => Err(TokenError::KeyNotAllowed(c.key)),
            Err(e) => Err(e),
        },
        Some(_) => Err(TokenError::UnknownKeyId),
    };
    assert_eq!(keyring().verify(wire), expected, "{wire:?}");
}

/// `token_roundtrip`: a claim built from the input is signed, verified and
/// then tampered with once.
///
/// Input: byte 0 the edit (0 none, 1 replace, 2 insert, 3 delete), bytes 1–2
/// its position, byte 3 the byte put in; then the text
/// `<key id>\n<token>\n<lease id>\n<lock key…>` (a key id the configuration
/// would refuse becomes `k1`; a token that is not a number is hashed).
///
/// - sign → verify gives the claim back, through a `Signer`, a `Keyring`
///   (and a prefix-limited one) and `parse_unverified`;
/// - the wire form is header-safe (`[A-Za-z0-9._-]`), has six parts and
///   carries the lease's tag, not its id;
/// - any one-byte edit that changes the string makes it fail to verify.
pub fn token_roundtrip(data: &[u8]) {
    if data.len() < 4 {
        return;
    }
    let (op, pos, byte) = (
        data[0] % 4,
        usize::from(data[1]) << 8 | usize::from(data[2]),
        data[3],
    );
    let text = String::from_utf8_lossy(&data[4..]);
    let mut fields = text.splitn(4, '\n');
    let kid = fields.next().unwrap_or("");
    let kid = if valid_key_id(kid) { kid } else { "k1" };
    let token_text = fields.next().unwrap_or("");
    let token = token_text
        .parse::<u64>()
        .unwrap_or_else(|_| Rng::new(token_text.as_bytes()).next());
    let lease_id = fields.next().unwrap_or("");
    let key = fields.next().unwrap_or("");

    let signer = Signer::new(kid, SECRET_K1);
    let claim = Claim::new(key, token, lease_id);
    assert_eq!(claim.lease, lease_tag(lease_id));
    let wire = signer.sign(&claim);

    assert!(
        wire.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')),
        "not header-safe: {wire:?}"
    );
    let parts: Vec<&str> = wire.split('.').collect();
    assert_eq!(parts.len(), 6, "{wire:?}");
    assert_eq!(
        (parts[0], parts[1], parts[2], parts[3]),
        (
            "v2",
            kid,
            token.to_string().as_str(),
            lease_tag(lease_id).as_str()
        )
    );

    assert_eq!(signer.verify(&wire).as_ref(), Ok(&claim), "{wire:?}");
    assert_eq!(parse_unverified(&wire).as_ref(), Some(&claim));
    let ring = Keyring::new(&[
        // A decoy id the configuration would refuse, so it never equals `kid`.
        ("decoy.id".into(), SECRET_K2.to_vec()),
        (kid.into(), SECRET_K1.to_vec()),
    ]);
    assert_eq!(ring.verify(&wire).as_ref(), Ok(&claim));
    // A prefix the key has is accepted; one it lacks is refused by name.
    let cut = key
        .char_indices()
        .nth(usize::from(byte) % 4)
        .map_or(key.len(), |(i, _)| i);
    let prefix = &key[..cut];
    let limited =
        |p: &str| Keyring::with_prefixes(&[(kid.into(), SECRET_K1.to_vec(), vec![p.into()])]);
    assert_eq!(limited(prefix).verify(&wire).as_ref(), Ok(&claim));
    let foreign = format!("{key}\u{1}");
    assert_eq!(
        limited(&foreign).verify(&wire),
        Err(TokenError::KeyNotAllowed(key.to_owned()))
    );
    // Another secret under the same key id does not verify.
    assert_eq!(
        Signer::new(kid, SECRET_K2).verify(&wire),
        Err(TokenError::BadSignature)
    );

    let mut edited = wire.clone().into_bytes();
    let at = pos % (edited.len() + 1);
    match op {
        1 if at < edited.len() => edited[at] = byte,
        2 => edited.insert(at, byte),
        3 if at < edited.len() => {
            edited.remove(at);
        }
        _ => {}
    }
    let edited = String::from_utf8_lossy(&edited);
    if edited != wire {
        let r = signer.verify(&edited);
        assert!(
            r.is_err(),
            "edited token {edited:?} of {wire:?} verified: {r:?}"
        );
        assert!(ring.verify(&edited).is_err(), "{edited:?}");
    }
}

// ---------------------------------------------------------------------------
// Paths and routes.

/// Checks that `n` looks like a normal form: absolute, no empty, `.` or
/// `..` segment (unless `/` alone), no `\`, escapes upper-case and only of
/// bytes that are neither unreserved nor separators.
fn assert_normal_form(n: &str) {
    assert!(n.starts_with('/'), "{n:?}");
    if n == "/" {
        return;
    }
    for seg in n[1..].split('/') {
        assert!(!seg.is_empty(), "empty segment in {n:?}");
        let decoded = percent_decode(seg);
        assert!(decoded != b"." && decoded != b"..", "dot segment in {n:?}");
    }
    assert!(!n.contains('\\'), "{n:?}");
    let b = n.as_bytes();
    for (i, _) in n.match_indices('%') {
        let hi = b
            .get(i + 1)
            .copied()
            .filter(|c| c.is_ascii_digit() || (b'A'..=b'F').contains(c));
        let lo = b
            .get(i + 2)
            .copied()
            .filter(|c| c.is_ascii_digit() || (b'A'..=b'F').contains(c));
        let (Some(hi), Some(lo)) = (hi, lo) else {
            panic!("escape not as two upper-case hex digits in {n:?}");
        };
        let v = hex_value(hi).unwrap() << 4 | hex_value(lo).unwrap();
        assert!(!unreserved(v), "escaped unreserved byte in {n:?}");
        assert!(v != b'/' && v != b'\\', "escaped separator in {n:?}");
    }
}

/// Another spelling of the normal path `n`: some unreserved characters
/// percent-encoded, some escapes' hex in lower case. It must normalize to
/// `n` again.
fn respell(n: &str, rng: &mut Rng) -> String {
    let b = n.as_bytes();
    let mut out = String::with_capacity(n.len() * 2);
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' && i + 2 < b.len() {
            let esc = &n[i..i + 3];
            out.push_str(&if rng.bit() {
                esc.to_ascii_lowercase()
            } else {
                esc.to_owned()
            });
            i += 3;
            continue;
        }
        if unreserved(c) && rng.bit() {
            if rng.bit() {
                out.push_str(&format!("%{c:02x}"));
            } else {
                out.push_str(&format!("%{c:02X}"));
            }
            i += 1;
            continue;
        }
        // Copy the whole character (it may be several bytes of UTF-8).
        let len = n[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&n[i..i + len]);
        i += len;
    }
    out
}

/// `path_normalize`: `normalize` and `normalize_uri` on an arbitrary path.
///
/// - never panics; `NotAbsolute` exactly when the path does not start
///   with `/`;
/// - a normal form is in normal form (see [`assert_normal_form`]), is
///   idempotent (`normalize(normalize(x)) == normalize(x)`) and stands for
///   the same bytes as the input (decoding only changes spelling);
/// - every other spelling of it (unreserved characters encoded, hex in
///   lower case) has the same normal form;
/// - `normalize_uri` of a request target that parses as a URI agrees with
///   `normalize` on its path and keeps scheme, authority and query.
pub fn path_normalize(data: &[u8]) {
    let raw = String::from_utf8_lossy(data);
    let raw = raw.as_ref();
    match normalize(raw) {
        Ok(n) => {
            assert_normal_form(&n);
            assert_eq!(normalize(&n).as_ref(), Ok(&n), "not idempotent: {raw:?}");
            assert_eq!(
                percent_decode(&n),
                percent_decode(raw),
                "{raw:?} normalized to {n:?}, which stands for other bytes"
            );
            let mut rng = Rng::new(data);
            let other = respell(&n, &mut rng);
            assert_eq!(normalize(&other).as_ref(), Ok(&n), "{other:?}");
        }
        Err(e) => assert_eq!(
            e == PathError::NotAbsolute,
            !raw.starts_with('/'),
            "{raw:?}: {e}"
        ),
    }
    if let Ok(uri) = raw.parse::<hyper::Uri>() {
        let by_path = normalize(uri.path());
        match normalize_uri(&uri) {
            Ok(u) => {
                assert_eq!(by_path.as_deref(), Ok(u.path()), "{raw:?}");
                assert_eq!(u.query(), uri.query(), "{raw:?}");
                assert_eq!(u.scheme(), uri.scheme(), "{raw:?}");
                assert_eq!(u.authority(), uri.authority(), "{raw:?}");
            }
            Err(e) => assert_eq!(by_path, Err(e), "{raw:?}"),
        }
    }
}

/// Percent-encodes `v` as a path segment: unreserved bytes as they are,
/// other ASCII as upper-case escapes, non-ASCII bytes as escapes
/// (`escape_utf8`) or as raw UTF-8.
fn encode_segment(v: &str, escape_utf8: bool) -> String {
    let mut out = String::new();
    for c in v.chars() {
        if c.is_ascii() && unreserved(c as u8) || !c.is_ascii() && !escape_utf8 {
            out.push(c);
        } else {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
    out
}

/// A key template with `{name}` replaced by `vars[name]` (what a route's key
/// is documented to be).
fn substitute(template: &str, vars: &HashMap<&str, &str>) -> Option<String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}')? + start;
        out.push_str(vars.get(&rest[start + 1..end])?);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Some(out)
}

/// `route_match`: `Routes::compile` and `key_for`.
///
/// Input: the text `<path pattern>\n<key template>\n<probe path>\n<value>…`.
///
/// - compiling never panics, and refuses a pattern that is not absolute or
///   not in normal form;
/// - `key_for` never panics, on the probe path or its normal form;
/// - for a compiled route, the path built by putting the values into the
///   pattern's `{name}` segments (percent-encoded, or with raw UTF-8) is in
///   normal form, and `key_for` gives the key template with the same values
///   put in — what `/accounts/{id}` → `account:{id}` promises — exactly
///   when every value is made of the default variable characters
///   (`A-Za-z0-9_-`); otherwise no key (issue 26 item 8).
pub fn route_match(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let pattern = lines.next().unwrap_or("");
    let key = lines.next().unwrap_or("");
    let probe = lines.next().unwrap_or("");
    let values: Vec<&str> = lines.collect();

    let spec = RouteSpec {
        path: pattern.to_owned(),
        key: key.to_owned(),
        var_chars: None,
    };
    let Ok(routes) = Routes::compile(std::slice::from_ref(&spec)) else {
        return;
    };
    assert_eq!(
        normalize(pattern).as_deref(),
        Ok(pattern),
        "compiled {pattern:?}"
    );

    if let Some(k) = routes.key_for(probe) {
        let n = probe.strip_prefix('/').map(|p| p.split('/').count());
        assert_eq!(
            n,
            Some(pattern[1..].split('/').count()),
            "{probe:?} -> {k:?}"
        );
    }
    if let Ok(n) = normalize(probe) {
        let _ = routes.key_for(&n);
    }

    let mut next_value = values.iter().cycle();
    let mut vars: HashMap<&str, &str> = HashMap::new();
    let mut segments: Vec<(bool, &str)> = Vec::new();
    for seg in pattern[1..].split('/') {
        let name = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}'));
        match name {
            Some(name) if !name.contains(['{', '}']) => {
                let mut v = next_value.next().copied().unwrap_or("v");
                // One value per segment: empty, `.` and `..` segments and
                // (encoded) separators are refused by design, not by the
                // route.
                if matches!(v, "" | "." | "..") || v.contains(['/', '\\', ';']) {
                    v = "v";
                }
                vars.entry(name).or_insert(v);
                segments.push((true, v));
            }
            _ => segments.push((false, seg)),
        }
    }
    let Some(expected) = substitute(key, &vars) else {
        panic!("compiled a key template {key:?} that does not substitute");
    };
    let plain = |v: &str| {
        !v.is_empty()
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    let expected = segments
        .iter()
        .all(|&(var, v)| !var || plain(v))
        .then_some(expected);
    for escape_utf8 in [true, false] {
        let path = format!(
            "/{}",
            segments
                .iter()
                .map(|&(var, s)| if var {
                    encode_segment(s, escape_utf8)
                } else {
                    s.to_owned()
                })
                .collect::<Vec<_>>()
                .join("/")
        );
        assert_eq!(normalize(&path).as_ref(), Ok(&path), "{path:?}");
        assert_eq!(
            routes.key_for(&path),
            expected,
            "route {pattern:?} -> {key:?}, path {path:?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Lock keys and request bodies.

/// `lock_key`: `LockKey::parse` (and the API's `request::key`).
///
/// - a key is accepted exactly when it is 1–512 bytes without control
///   characters, and kept as it is;
/// - each refusal names its reason: `Empty`, `TooLong(len)`, or
///   `ControlChar(byte offset of the first control character)`;
/// - the API answers 400 `invalid_request` with `field: key` for each.
pub fn lock_key(data: &[u8]) {
    let raw = String::from_utf8_lossy(data);
    let raw = raw.as_ref();
    let first_control = raw
        .char_indices()
        .find(|(_, c)| c.is_control())
        .map(|(i, _)| i);
    match LockKey::parse(raw) {
        Ok(k) => {
            assert!(!raw.is_empty() && raw.len() <= MAX_KEY_BYTES, "{raw:?}");
            assert_eq!(first_control, None, "{raw:?}");
            assert_eq!(k.as_str(), raw);
            assert_eq!(k.to_string(), raw);
        }
        Err(e) => {
            use fencer::lock::key::KeyError;
            match e {
                KeyError::Empty => assert!(raw.is_empty()),
                KeyError::TooLong(n) => {
                    assert_eq!(n, raw.len());
                    assert!(n > MAX_KEY_BYTES);
                }
                KeyError::ControlChar(at) => {
                    assert!(!raw.is_empty() && raw.len() <= MAX_KEY_BYTES);
                    assert_eq!(Some(at), first_control, "{raw:?}");
                }
            }
        }
    }
    match request::key(raw) {
        Ok(k) => assert_eq!(k.as_str(), raw),
        Err(e) => {
            assert_eq!((e.status.as_u16(), e.code), (400, "invalid_request"));
            assert_eq!(e.extra.get("field"), Some(&Value::from("key")));
        }
    }
}

const DEFAULTS: Defaults = Defaults {
    ttl_ms: 1000,
    wait_ms: 0,
    keepalive_ms: 5000,
};

/// The body as the API reads it: an object, or `None` (invalid JSON or not
/// an object); a body of only whitespace is `{}`.
fn body_object(body: &[u8]) -> Option<Map<String, Value>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Some(Map::new());
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Some(map),
        _ => None,
    }
}

fn set<'a>(map: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    map.get(field).filter(|v| !v.is_null())
}

fn millis_ok(map: &Map<String, Value>, field: &str, min: u64, max: u64) -> bool {
    set(map, field).is_none_or(|v| v.as_u64().is_some_and(|n| (min..=max).contains(&n)))
}

/// Every field the README's limits refuse in an acquire/hold body: the
/// independent statement of "Limits: …, unknown JSON fields rejected".
fn acquire_problems(map: &Map<String, Value>, hold: bool) -> Vec<String> {
    let allowed: &[&str] = if hold {
        &["ttl_ms", "wait_ms", "owner"]
    } else {
        &["ttl_ms", "wait_ms", "owner", "auto_renew", "keepalive_ms"]
    };
    let mut bad: Vec<String> = map
        .keys()
        .filter(|k| !allowed.contains(&k.as_str()))
        .cloned()
        .collect();
    if !millis_ok(map, "ttl_ms", MIN_TTL_MS, MAX_TTL_MS) {
        bad.push("ttl_ms".into());
    }
    if !millis_ok(map, "wait_ms", 0, MAX_WAIT_MS) {
        bad.push("wait_ms".into());
    }
    if !hold {
        let auto = set(map, "auto_renew");
        if auto.is_some_and(|v| !v.is_boolean()) {
            bad.push("auto_renew".into());
        }
        let auto_on = auto == Some(&Value::Bool(true));
        if !millis_ok(map, "keepalive_ms", MIN_TTL_MS, MAX_TTL_MS)
            || set(map, "keepalive_ms").is_some() && !auto_on
        {
            bad.push("keepalive_ms".into());
        }
    }
    if let Some(owner) = set(map, "owner") {
        let ok = owner
            .as_str()
            .is_some_and(|s| s.len() <= MAX_OWNER_BYTES && !s.chars().any(char::is_control));
        if !ok {
            bad.push("owner".into());
        }
    }
    bad
}

fn lease_problems(map: &Map<String, Value>, with_ttl: bool) -> Vec<String> {
    let allowed: &[&str] = if with_ttl {
        &["lease_id", "ttl_ms"]
    } else {
        &["lease_id"]
    };
    let mut bad: Vec<String> = map
        .keys()
        .filter(|k| !allowed.contains(&k.as_str()))
        .cloned()
        .collect();
    let id_ok = map
        .get("lease_id")
        .and_then(Value::as_str)
        .is_some_and(|s| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if !id_ok {
        bad.push("lease_id".into());
    }
    if with_ttl && !millis_ok(map, "ttl_ms", MIN_TTL_MS, MAX_TTL_MS) {
        bad.push("ttl_ms".into());
    }
    bad
}

/// The refusal of a body: 400 `invalid_request` naming `body` (when it is
/// not a JSON object) or one of the fields at fault.
fn assert_refusal(err: &fencer::error::ApiError, map: Option<&Map<String, Value>>, bad: &[String]) {
    assert_eq!(
        (err.status.as_u16(), err.code),
        (400, "invalid_request"),
        "{}",
        err.message
    );
    assert!(!err.message.is_empty());
    let field = err.extra.get("field").and_then(Value::as_str);
    match map {
        None => assert_eq!(field, Some("body"), "{}", err.message),
        Some(_) => assert!(
            field.is_some_and(|f| bad.iter().any(|b| b == f)),
            "refused {field:?} ({}), but the faults are {bad:?}",
            err.message
        ),
    }
}

fn millis_or(map: &Map<String, Value>, field: &str, default: u64) -> Duration {
    Duration::from_millis(set(map, field).and_then(Value::as_u64).unwrap_or(default))
}

/// `request_body`: the lock API's JSON bodies.
///
/// Input: byte 0 picks the call (acquire, hold, renew, release/keepalive),
/// the rest is the body.
///
/// - never panics; a body is refused exactly when it is not a JSON object
///   (or blank) or breaks one of the documented limits (`ttl_ms` and
///   `keepalive_ms` 100–3 600 000, `wait_ms` 0–300 000, `owner` ≤ 256 bytes
///   without control characters, `keepalive_ms` only with `auto_renew`,
///   `lease_id` 1–64 of `[A-Za-z0-9_-]`, no unknown field), and then with
///   400 `invalid_request` naming `body` or a field at fault;
/// - an accepted body yields exactly its values, or the defaults.
pub fn request_body(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let map = body_object(body);
    match which % 4 {
        kind @ (0 | 1) => {
            let hold = kind == 1;
            let bad = map
                .as_ref()
                .map(|m| acquire_problems(m, hold))
                .unwrap_or_default();
            match request::acquire(body, &DEFAULTS, hold) {
                Err(e) => {
                    assert!(
                        map.is_none() || !bad.is_empty(),
                        "refused a good body: {}",
                        e.message
                    );
                    assert_refusal(&e, map.as_ref(), &bad);
                }
                Ok(r) => {
                    let m = map.expect("accepted a body that is not a JSON object");
                    assert!(bad.is_empty(), "accepted a body with faults {bad:?}");
                    assert_eq!(r.ttl, millis_or(&m, "ttl_ms", DEFAULTS.ttl_ms));
                    assert_eq!(r.wait, millis_or(&m, "wait_ms", DEFAULTS.wait_ms));
                    assert_eq!(r.owner.as_deref(), set(&m, "owner").and_then(Value::as_str));
                    let expected = if hold {
                        Renewal::Hold
                    } else if set(&m, "auto_renew") == Some(&Value::Bool(true)) {
                        Renewal::Auto {
                            keepalive: millis_or(&m, "keepalive_ms", DEFAULTS.keepalive_ms),
                        }
                    } else {
                        Renewal::Manual
                    };
                    assert_eq!(r.renewal, expected);
                }
            }
        }
        kind => {
            let with_ttl = kind == 2;
            let bad = map
                .as_ref()
                .map(|m| lease_problems(m, with_ttl))
                .unwrap_or_default();
            match request::lease(body, with_ttl) {
                Err(e) => {
                    assert!(
                        map.is_none() || !bad.is_empty(),
                        "refused a good body: {}",
                        e.message
                    );
                    assert_refusal(&e, map.as_ref(), &bad);
                }
                Ok(r) => {
                    let m = map.expect("accepted a body that is not a JSON object");
                    assert!(bad.is_empty(), "accepted a body with faults {bad:?}");
                    let id = m.get("lease_id").and_then(Value::as_str);
                    assert_eq!(Some(r.lease_id.as_str()), id);
                    assert_eq!(
                        LeaseId::parse(r.lease_id.as_str()).as_ref(),
                        Some(&r.lease_id)
                    );
                    let ttl = with_ttl
                        .then(|| set(&m, "ttl_ms").and_then(Value::as_u64))
                        .flatten()
                        .map(Duration::from_millis);
                    assert_eq!(r.ttl, ttl);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Configuration.

static CONFIG_FILES: AtomicU64 = AtomicU64::new(0);

/// `config_load`: `Settings::load` on arbitrary bytes as the TOML file.
///
/// - never panics, whatever the file holds;
/// - `Ok` implies `validate()` is `Ok` (for the redacted copy too): a loaded
///   configuration is a valid one;
/// - loading is deterministic: the same file loads (or fails, naming the
///   same invalid field) the same way twice.
///
/// `FENCER__…` environment variables take part in loading; the fuzzer and
/// the replay test are meant to run without any.
pub fn config_load(data: &[u8]) {
    let n = CONFIG_FILES.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "fencer-fuzz-config-{}-{n}.toml",
        std::process::id()
    ));
    std::fs::write(&path, data).expect("write the config file");
    let first = Settings::load(Some(&path));
    let second = Settings::load(Some(&path));
    let _ = std::fs::remove_file(&path);
    match (&first, &second) {
        (Ok(s), Ok(_)) => {
            if let Err(e) = s.validate() {
                panic!("loaded, yet invalid: {e}");
            }
            if let Err(e) = s.redacted().validate() {
                panic!("loaded, yet its redacted copy is invalid: {e}");
            }
        }
        (Err(a), Err(b)) => {
            assert!(!a.to_string().is_empty());
            // Which field a failed validation names is deterministic. A
            // load error is not quite: with several unknown fields, serde
            // names whichever the `config` crate's map yields first, and
            // that order changes between runs (fuzz/README.md, findings).
            if let (
                ConfigError::Invalid { field: fa, .. },
                ConfigError::Invalid { field: fb, .. },
            ) = (a, b)
            {
                assert_eq!(fa, fb);
            }
            assert_eq!(
                matches!(a, ConfigError::Load(_)),
                matches!(b, ConfigError::Load(_))
            );
        }
        _ => panic!("loaded differently twice: {first:?} / {second:?}"),
    }
}
