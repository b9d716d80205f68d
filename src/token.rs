//! Signed fencing tokens: the form of a token that the gateway trusts.
//!
//! Wire form (URL-safe, fits in a header):
//! `v1.<key id>.<token>.<lease id>.<base64url(lock key)>.<base64url(hmac)>`
//!
//! The HMAC-SHA256 covers the version, key id, lock key, token and lease id,
//! so a token cannot be moved to another key, inflated, or re-attributed to
//! another lease. The key id lets the gateway accept several secrets during
//! a rotation.

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

const VERSION: &str = "v1";

/// What a signed token asserts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub key: String,
    pub token: u64,
    pub lease_id: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("malformed fencing token")]
    Malformed,
    #[error("unknown signing key id")]
    UnknownKeyId,
    #[error("bad signature")]
    BadSignature,
}

/// Signs claims with one secret.
#[derive(Clone)]
pub struct Signer {
    key_id: String,
    mac: HmacSha256,
}

fn message(key_id: &str, claim: &Claim) -> Vec<u8> {
    let mut m = Vec::with_capacity(64 + claim.key.len());
    for part in [
        VERSION,
        key_id,
        &claim.key,
        &claim.token.to_string(),
        &claim.lease_id,
    ] {
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
        let mut mac = self.mac.clone();
        mac.update(&message(&self.key_id, claim));
        let sig = mac.finalize().into_bytes();
        format!(
            "{VERSION}.{}.{}.{}.{}.{}",
            self.key_id,
            claim.token,
            claim.lease_id,
            B64.encode(claim.key.as_bytes()),
            B64.encode(sig)
        )
    }

    /// Verifies a token signed with this signer's key id (constant-time MAC
    /// comparison).
    pub fn verify(&self, wire: &str) -> Result<Claim, TokenError> {
        let parts: Vec<&str> = wire.split('.').collect();
        let [version, kid, token, lease, key, sig] = parts[..] else {
            return Err(TokenError::Malformed);
        };
        if version != VERSION {
            return Err(TokenError::Malformed);
        }
        if kid != self.key_id {
            return Err(TokenError::UnknownKeyId);
        }
        let token: u64 = token.parse().map_err(|_| TokenError::Malformed)?;
        let key = B64
            .decode(key)
            .ok()
            .and_then(|k| String::from_utf8(k).ok())
            .ok_or(TokenError::Malformed)?;
        let sig = B64.decode(sig).map_err(|_| TokenError::Malformed)?;
        let claim = Claim {
            key,
            token,
            lease_id: lease.to_owned(),
        };
        let mut mac = self.mac.clone();
        mac.update(&message(kid, &claim));
        mac.verify_slice(&sig)
            .map_err(|_| TokenError::BadSignature)?;
        Ok(claim)
    }
}

/// The set of keys a verifier accepts, by key id (rotation: old and new
/// are both present during a roll-over).
#[derive(Clone)]
pub struct Keyring {
    signers: Vec<Signer>,
}

impl Keyring {
    pub fn new(keys: &[(String, Vec<u8>)]) -> Keyring {
        Keyring {
            signers: keys
                .iter()
                .map(|(kid, secret)| Signer::new(kid, secret))
                .collect(),
        }
    }

    pub fn verify(&self, wire: &str) -> Result<Claim, TokenError> {
        let kid = wire.split('.').nth(1).ok_or(TokenError::Malformed)?;
        self.signers
            .iter()
            .find(|s| s.key_id() == kid)
            .ok_or(TokenError::UnknownKeyId)?
            .verify(wire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> Claim {
        Claim {
            key: "account:1".into(),
            token: 34,
            lease_id: "abc".into(),
        }
    }

    #[test]
    fn round_trip() {
        let s = Signer::new("k1", &[7u8; 32]);
        let wire = s.sign(&claim());
        assert_eq!(s.verify(&wire), Ok(claim()));
    }

    #[test]
    fn tampering_is_detected() {
        let s = Signer::new("k1", &[7u8; 32]);
        let wire = s.sign(&claim());
        let inflated = wire.replacen(".34.", ".35.", 1);
        assert_eq!(s.verify(&inflated), Err(TokenError::BadSignature));
        let other = Signer::new("k1", &[8u8; 32]);
        assert_eq!(other.verify(&wire), Err(TokenError::BadSignature));
        assert_eq!(s.verify("garbage"), Err(TokenError::Malformed));
        let k2 = Signer::new("k2", &[7u8; 32]);
        assert_eq!(k2.verify(&wire), Err(TokenError::UnknownKeyId));
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
}
