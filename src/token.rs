//! Signed fencing tokens: the form of a token that the gateway trusts.
//!
//! Wire forms (URL-safe, fit in a header):
//! - a write lease's: `v2.<key id>.<token>.<lease tag>.<base64url(lock key)>.<base64url(hmac)>`
//! - a read lease's: `v3.<key id>.<token>.<lease tag>.<base64url(lock key)>.r.<base64url(hmac)>`
//!
//! The HMAC-SHA256 covers the version, key id, lock key, token, lease tag
//! and (v3) the mode, so a token cannot be moved to another key, inflated,
//! re-attributed to another lease, or turned from a read lease's into a
//! write lease's. The key id lets the gateway accept several secrets
//! during a rotation.
//!
//! **Mode.** A read lease (read-write locks) shares its key with other
//! readers, so its token may write nothing: the gateway refuses a write
//! carrying it (`read_lease`) and admits reads with it by a rule of their
//! own ([`crate::gateway::fence_store::decide`]). Write leases keep the v2
//! form, byte for byte: a gateway of the previous version goes on
//! accepting an upgraded sidecar's write tokens during a roll-out, and
//! refuses its read tokens as malformed — it cannot tell a read token's
//! mode, and refusing is the safe way not to know.
//!
//! The **lease tag** stands in for the lease id. The lease id is the
//! credential that renews and releases a lock; a token travels to the
//! storage, into its logs and into the gateway's logs, so it must not carry
//! that credential (issue 9 item 11). The tag is a one-way digest of the id:
//! it tells leases apart (an equal token from another lease is refused) and
//! cannot be turned back into the id.
//!
//! `v1` tokens (lease id in clear), from sidecars of earlier versions, are
//! still verified during a rolling upgrade; the gateway reduces their lease
//! id to its tag at once and never logs or stores the id.

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// A token this far above a key's previous one is not how fencer mints
/// tokens (2^40 is about 12 days of the Redis hybrid clock): the gateway
/// counts and logs it as an alarm (PITFALLS 4), and the sidecar refuses to
/// "repair" its backend counter up to such a mark.
pub const TOKEN_JUMP: u64 = 1 << 40;

const VERSION: &str = "v2";
const VERSION_V1: &str = "v1";
/// A token with a mode part; only read leases are signed in it (one wire
/// form per claim: a write claim is always v2).
const VERSION_MODE: &str = "v3";
const READ: &str = "r";

/// The one-way tag of a lease id: base64url of the first 12 bytes of
/// SHA-256 over a fixed prefix and the id (16 characters). 96 bits keep two
/// leases' tags apart; the id stays secret.
pub fn lease_tag(lease_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"fencer-lease-tag:");
    h.update(lease_id.as_bytes());
    B64.encode(&h.finalize()[..12])
}

/// What a lease may do with the key it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Mode {
    /// Exclusive: reads and writes (every lease but a read-write lock's
    /// readers).
    #[default]
    Write,
    /// Shared with other readers: reads only.
    Read,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Write => "write",
            Mode::Read => "read",
        }
    }
}

/// What a signed token asserts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub key: String,
    pub token: u64,
    /// The lease's tag ([`lease_tag`]), never the lease id itself.
    pub lease: String,
    pub mode: Mode,
}

impl Claim {
    /// The claim of write lease `lease_id` on `key` with `token`.
    pub fn new(key: &str, token: u64, lease_id: &str) -> Claim {
        Claim::with_mode(key, token, lease_id, Mode::Write)
    }

    /// The claim of lease `lease_id`, of `mode`, on `key` with `token`.
    pub fn with_mode(key: &str, token: u64, lease_id: &str, mode: Mode) -> Claim {
        Claim {
            key: key.to_owned(),
            token,
            lease: lease_tag(lease_id),
            mode,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("malformed fencing token")]
    Malformed,
    #[error("unknown signing key id")]
    UnknownKeyId,
    #[error("bad signature")]
    BadSignature,
    #[error("this signing key may not sign tokens for key `{0}`")]
    KeyNotAllowed(String),
}

/// Signs claims with one secret.
#[derive(Clone)]
pub struct Signer {
    key_id: String,
    mac: HmacSha256,
}

/// The signed message. `mode`: v3's mode part (v1 and v2 have none, and
/// their messages are unchanged).
fn message(
    version: &str,
    key_id: &str,
    key: &str,
    token: u64,
    lease: &str,
    mode: Option<&str>,
) -> Vec<u8> {
    let mut m = Vec::with_capacity(72 + key.len());
    let token = token.to_string();
    let parts = [version, key_id, key, &token, lease];
    for part in parts.into_iter().chain(mode) {
        // Length-prefixed so no two claims share a message.
        m.extend_from_slice(&(part.len() as u32).to_be_bytes());
        m.extend_from_slice(part.as_bytes());
    }
    m
}

impl Signer {
    pub fn new(key_id: &str, secret: &[u8]) -> Signer {
        Signer {
            key_id: key_id.to_owned(),
            mac: HmacSha256::new_from_slice(secret).expect("hmac accepts any key length"),
        }
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    pub fn sign(&self, claim: &Claim) -> String {
        let (version, mode) = match claim.mode {
            Mode::Write => (VERSION, None),
            Mode::Read => (VERSION_MODE, Some(READ)),
        };
        let mut mac = self.mac.clone();
        mac.update(&message(
            version,
            &self.key_id,
            &claim.key,
            claim.token,
            &claim.lease,
            mode,
        ));
        let sig = B64.encode(mac.finalize().into_bytes());
        let key = B64.encode(claim.key.as_bytes());
        let (kid, token, lease) = (&self.key_id, claim.token, &claim.lease);
        match mode {
            None => format!("{version}.{kid}.{token}.{lease}.{key}.{sig}"),
            Some(m) => format!("{version}.{kid}.{token}.{lease}.{key}.{m}.{sig}"),
        }
    }

    /// Verifies a token signed with this signer's key id (constant-time MAC
    /// comparison). A `v1` token's lease id is reduced to its tag. The token
    /// number must be spelled as [`Signer::sign`] spells it (no leading
    /// zero), so one signed claim has one wire form.
    pub fn verify(&self, wire: &str) -> Result<Claim, TokenError> {
        let parts: Vec<&str> = wire.split('.').collect();
        let (version, kid, token, lease, key, mode, sig) = match parts[..] {
            [v, kid, token, lease, key, sig] if v == VERSION || v == VERSION_V1 => {
                (v, kid, token, lease, key, None, sig)
            }
            // Read leases only: a write claim has the one (v2) form.
            [v, kid, token, lease, key, READ, sig] if v == VERSION_MODE => {
                (v, kid, token, lease, key, Some(READ), sig)
            }
            _ => return Err(TokenError::Malformed),
        };
        if kid != self.key_id {
            return Err(TokenError::UnknownKeyId);
        }
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_digit()) {
            return Err(TokenError::Malformed);
        }
        // One spelling per token: the MAC covers the number, not its text,
        // so `034` would verify with the signature of `34` — a second wire
        // form of one signed claim, which the SQL verifier (it signs the
        // text) refuses. Signers never write a leading zero (found by
        // fuzzing, `fuzz/regressions/token_roundtrip`).
        if token.len() > 1 && token.starts_with('0') {
            return Err(TokenError::Malformed);
        }
        let token: u64 = token.parse().map_err(|_| TokenError::Malformed)?;
        if lease.is_empty()
            || lease.len() > 64
            || !lease
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(TokenError::Malformed);
        }
        let key = B64
            .decode(key)
            .ok()
            .and_then(|k| String::from_utf8(k).ok())
            .ok_or(TokenError::Malformed)?;
        let sig = B64.decode(sig).map_err(|_| TokenError::Malformed)?;
        let mut mac = self.mac.clone();
        mac.update(&message(version, kid, &key, token, lease, mode));
        mac.verify_slice(&sig)
            .map_err(|_| TokenError::BadSignature)?;
        let lease = if version == VERSION_V1 {
            lease_tag(lease)
        } else {
            lease.to_owned()
        };
        let mode = match mode {
            Some(_) => Mode::Read,
            None => Mode::Write,
        };
        Ok(Claim {
            key,
            token,
            lease,
            mode,
        })
    }
}

/// The claims of a token **without** verifying them: for the fault suite's
/// `skip_signature` mutant only (the gateway never calls it otherwise).
pub fn parse_unverified(wire: &str) -> Option<Claim> {
    let parts: Vec<&str> = wire.split('.').collect();
    let (token, lease, key, mode) = match parts[..] {
        [_, _, token, lease, key, _] => (token, lease, key, Mode::Write),
        [_, _, token, lease, key, _, _] => (token, lease, key, Mode::Read),
        _ => return None,
    };
    Some(Claim {
        key: String::from_utf8(B64.decode(key).ok()?).ok()?,
        token: token.parse().ok()?,
        lease: lease.to_owned(),
        mode,
    })
}

/// The set of keys a verifier accepts, by key id (rotation: old and new
/// are both present during a roll-over), each optionally limited to lock
/// keys with given prefixes: with one secret per team (namespace, app), a
/// leaked secret signs only that team's keys.
#[derive(Clone)]
pub struct Keyring {
    signers: Vec<(Signer, Vec<String>)>,
}

impl Keyring {
    /// `(key id, secret)` pairs that may sign any lock key.
    pub fn new(keys: &[(String, Vec<u8>)]) -> Keyring {
        Keyring::with_prefixes(
            &keys
                .iter()
                .map(|(k, s)| (k.clone(), s.clone(), Vec::new()))
                .collect::<Vec<_>>(),
        )
    }

    /// `(key id, secret, allowed key prefixes)`; no prefixes: any key.
    pub fn with_prefixes(keys: &[(String, Vec<u8>, Vec<String>)]) -> Keyring {
        Keyring {
            signers: keys
                .iter()
                .map(|(kid, secret, prefixes)| (Signer::new(kid, secret), prefixes.clone()))
                .collect(),
        }
    }

    pub fn verify(&self, wire: &str) -> Result<Claim, TokenError> {
        let kid = wire.split('.').nth(1).ok_or(TokenError::Malformed)?;
        let (signer, prefixes) = self
            .signers
            .iter()
            .find(|(s, _)| s.key_id() == kid)
            .ok_or(TokenError::UnknownKeyId)?;
        let claim = signer.verify(wire)?;
        if !prefixes.is_empty() && !prefixes.iter().any(|p| claim.key.starts_with(p.as_str())) {
            return Err(TokenError::KeyNotAllowed(claim.key));
        }
        Ok(claim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> Claim {
        Claim::new("account:1", 34, "abc")
    }

    #[test]
    fn round_trip() {
        let s = Signer::new("k1", &[7u8; 32]);
        let wire = s.sign(&claim());
        assert_eq!(s.verify(&wire), Ok(claim()));
    }

    #[test]
    fn the_lease_id_is_not_in_the_token() {
        let s = Signer::new("k1", &[7u8; 32]);
        let id = "Zq3vX9mN2pL8rT5wY1bC4d";
        let wire = s.sign(&Claim::new("k", 1, id));
        assert!(!wire.contains(id), "{wire}");
        assert_eq!(s.verify(&wire).unwrap().lease, lease_tag(id));
        assert_ne!(lease_tag(id), lease_tag("Zq3vX9mN2pL8rT5wY1bC4e"));
    }

    #[test]
    fn v1_tokens_verify_and_reduce_to_the_tag() {
        let secret = [7u8; 32];
        let s = Signer::new("k1", &secret);
        let mut mac = HmacSha256::new_from_slice(&secret).unwrap();
        mac.update(&message("v1", "k1", "account:1", 34, "abc", None));
        let sig = B64.encode(mac.finalize().into_bytes());
        let wire = format!("v1.k1.34.abc.{}.{sig}", B64.encode("account:1"));
        assert_eq!(s.verify(&wire), Ok(claim()));
    }

    #[test]
    fn tampering_is_detected() {
        let s = Signer::new("k1", &[7u8; 32]);
        let wire = s.sign(&claim());
        let inflated = wire.replacen(".34.", ".35.", 1);
        assert_eq!(s.verify(&inflated), Err(TokenError::BadSignature));
        let plus = wire.replacen(".34.", ".+34.", 1);
        assert_eq!(s.verify(&plus), Err(TokenError::Malformed));
        let zero = wire.replacen(".34.", ".034.", 1);
        assert_eq!(s.verify(&zero), Err(TokenError::Malformed));
        let other = Signer::new("k1", &[8u8; 32]);
        assert_eq!(other.verify(&wire), Err(TokenError::BadSignature));
        assert_eq!(s.verify("garbage"), Err(TokenError::Malformed));
        let k2 = Signer::new("k2", &[7u8; 32]);
        assert_eq!(k2.verify(&wire), Err(TokenError::UnknownKeyId));
        // A v2 token relabelled v1 no longer matches its signature.
        let relabelled = wire.replacen("v2.", "v1.", 1);
        assert_eq!(s.verify(&relabelled), Err(TokenError::BadSignature));
    }

    #[test]
    fn a_read_claim_carries_its_mode_and_cannot_lose_it() {
        let s = Signer::new("k1", &[7u8; 32]);
        let read = Claim::with_mode("account:1", 35, "abc", Mode::Read);
        let wire = s.sign(&read);
        assert!(wire.starts_with("v3.k1.35."), "{wire}");
        assert_eq!(s.verify(&wire), Ok(read.clone()));
        // A write claim keeps the v2 form of earlier versions.
        assert!(s.sign(&claim()).starts_with("v2.k1.34."));
        // The mode part dropped, or relabelled: not a valid token.
        let parts: Vec<&str> = wire.split('.').collect();
        let dropped = [&parts[..5], &parts[6..]].concat().join(".");
        assert_eq!(s.verify(&dropped), Err(TokenError::Malformed));
        let as_v2 = dropped.replacen("v3.", "v2.", 1);
        assert_eq!(s.verify(&as_v2), Err(TokenError::BadSignature));
        let as_write = wire.replacen(".r.", ".w.", 1);
        assert_eq!(s.verify(&as_write), Err(TokenError::Malformed));
        assert_eq!(parse_unverified(&wire).map(|c| c.mode), Some(Mode::Read));
    }

    #[test]
    fn keyring_accepts_every_configured_key() {
        let old = Signer::new("old", &[1u8; 32]);
        let new = Signer::new("new", &[2u8; 32]);
        let ring = Keyring::new(&[("old".into(), vec![1u8; 32]), ("new".into(), vec![2u8; 32])]);
        assert_eq!(ring.verify(&old.sign(&claim())), Ok(claim()));
        assert_eq!(ring.verify(&new.sign(&claim())), Ok(claim()));
        let retired = Keyring::new(&[("new".into(), vec![2u8; 32])]);
        assert_eq!(
            retired.verify(&old.sign(&claim())),
            Err(TokenError::UnknownKeyId)
        );
    }

    #[test]
    fn a_key_limited_to_prefixes_signs_nothing_else() {
        let team_a = Signer::new("a", &[3u8; 32]);
        let ring = Keyring::with_prefixes(&[("a".into(), vec![3u8; 32], vec!["team-a/".into()])]);
        let mine = Claim::new("team-a/orders", 1, "l");
        assert_eq!(ring.verify(&team_a.sign(&mine)), Ok(mine));
        let theirs = Claim::new("team-b/orders", 1, "l");
        assert_eq!(
            ring.verify(&team_a.sign(&theirs)),
            Err(TokenError::KeyNotAllowed("team-b/orders".into()))
        );
    }
}
