//! The etcd v3 API's JSON form, as its gRPC gateway speaks it: keys and
//! values base64, 64-bit integers as strings, fields at their zero value
//! left out (so every answer field defaults).

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};

/// Bytes as the gateway wants them.
pub fn b64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// The key just past every key that starts with `prefix` (a range's
/// `range_end`): the prefix with its last byte below 0xff incremented, or
/// `\0` — every key — if there is none.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn num<'de, D: Deserializer<'de>, T: std::str::FromStr + TryFrom<i64>>(d: D) -> Result<T, D::Error>
where
    <T as TryFrom<i64>>::Error: std::fmt::Display,
    <T as std::str::FromStr>::Err: std::fmt::Display,
{
    match Value::deserialize(d)? {
        Value::String(s) => s.parse().map_err(serde::de::Error::custom),
        Value::Number(n) => n
            .as_i64()
            .ok_or_else(|| serde::de::Error::custom(format!("{n} is no 64-bit integer")))
            .and_then(|n| T::try_from(n).map_err(serde::de::Error::custom)),
        Value::Null => T::try_from(0).map_err(serde::de::Error::custom),
        other => Err(serde::de::Error::custom(format!("{other} is no integer"))),
    }
}

fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = Option::<String>::deserialize(d)?.unwrap_or_default();
    STANDARD.decode(s).map_err(serde::de::Error::custom)
}

/// Every answer's header: the store's revision when it was served, and
/// the Raft term of the member that served it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Header {
    #[serde(deserialize_with = "num")]
    pub revision: i64,
    #[serde(deserialize_with = "num")]
    pub raft_term: u64,
    #[serde(deserialize_with = "num")]
    pub member_id: u64,
}

/// One key as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct KeyValue {
    #[serde(deserialize_with = "bytes")]
    pub key: Vec<u8>,
    /// The revision of the write that created the key (since its last
    /// deletion): cluster-wide, strictly increasing, never reused.
    #[serde(deserialize_with = "num")]
    pub create_revision: i64,
    #[serde(deserialize_with = "num")]
    pub mod_revision: i64,
    #[serde(deserialize_with = "num")]
    pub version: i64,
    #[serde(deserialize_with = "bytes")]
    pub value: Vec<u8>,
    /// The lease the key is attached to (0: none).
    #[serde(deserialize_with = "num")]
    pub lease: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct RangeResponse {
    pub header: Header,
    pub kvs: Vec<KeyValue>,
    #[serde(deserialize_with = "num")]
    pub count: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct PutResponse {
    pub header: Header,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct DeleteResponse {
    pub header: Header,
    #[serde(deserialize_with = "num")]
    pub deleted: i64,
}

/// One answer of a transaction's branch, in the order of its operations.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub enum OpResponse {
    #[serde(rename = "response_range")]
    Range(RangeResponse),
    #[serde(rename = "response_put")]
    Put(PutResponse),
    #[serde(rename = "response_delete_range")]
    Delete(DeleteResponse),
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct TxnResponse {
    pub header: Header,
    /// The comparisons held: the `success` branch ran (else `failure`).
    pub succeeded: bool,
    pub responses: Vec<OpResponse>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct LeaseGrantResponse {
    pub header: Header,
    #[serde(rename = "ID", deserialize_with = "num")]
    pub id: i64,
    #[serde(rename = "TTL", deserialize_with = "num")]
    pub ttl: i64,
}

/// What a lease has left: `ttl` whole seconds (etcd truncates; -1: the
/// lease is gone) of the `granted_ttl` it was granted or last kept alive
/// for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct LeaseTimeToLiveResponse {
    pub header: Header,
    #[serde(rename = "ID", deserialize_with = "num")]
    pub id: i64,
    #[serde(rename = "TTL", deserialize_with = "num")]
    pub ttl: i64,
    #[serde(rename = "grantedTTL", deserialize_with = "num")]
    pub granted_ttl: i64,
}

/// A keepalive's answer: the lease's TTL again, or 0 — the lease is gone
/// (expired or revoked).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct KeepAliveResponse {
    pub header: Header,
    #[serde(rename = "ID", deserialize_with = "num")]
    pub id: i64,
    #[serde(rename = "TTL", deserialize_with = "num")]
    pub ttl: i64,
}

/// What a key's write did, as a watch reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum EventType {
    #[default]
    #[serde(rename = "PUT")]
    Put,
    #[serde(rename = "DELETE")]
    Delete,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Event {
    #[serde(rename = "type")]
    pub kind: EventType,
    pub kv: KeyValue,
}

/// One message of a watch stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct WatchResponse {
    pub header: Header,
    pub created: bool,
    pub canceled: bool,
    /// Set when the watch asked for history the store has compacted away:
    /// the oldest revision it still has.
    #[serde(deserialize_with = "num")]
    pub compact_revision: i64,
    pub cancel_reason: String,
    pub events: Vec<Event>,
}

/// An error answer of the gateway: the gRPC status code and its message.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ErrorBody {
    pub code: i32,
    pub message: String,
}

/// Which field of a key a comparison looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Its creation revision (0: the key does not exist).
    Create,
    /// The revision of its last write.
    Mod,
    /// Its value.
    Value,
    /// The lease it is attached to (0: none).
    Lease,
}

/// A comparison of a transaction: `target` of `key` equal to `revision`
/// (a lease id for [`Target::Lease`]; for [`Target::Value`], `value`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compare {
    pub key: Vec<u8>,
    pub target: Target,
    pub revision: i64,
    pub value: Vec<u8>,
}

impl Compare {
    /// `key` does not exist.
    pub fn absent(key: &[u8]) -> Compare {
        Compare {
            key: key.to_vec(),
            target: Target::Create,
            revision: 0,
            value: Vec::new(),
        }
    }

    /// `key` exists and was created at `revision` (it is the same key,
    /// not one deleted and made again).
    pub fn created(key: &[u8], revision: i64) -> Compare {
        Compare {
            key: key.to_vec(),
            target: Target::Create,
            revision,
            value: Vec::new(),
        }
    }

    /// `key`'s last write is `revision` (nobody wrote it since it was read;
    /// 0: it still does not exist).
    pub fn unchanged(key: &[u8], revision: i64) -> Compare {
        Compare {
            key: key.to_vec(),
            target: Target::Mod,
            revision,
            value: Vec::new(),
        }
    }

    /// `key` holds `value`.
    pub fn holds(key: &[u8], value: &[u8]) -> Compare {
        Compare {
            key: key.to_vec(),
            target: Target::Value,
            revision: 0,
            value: value.to_vec(),
        }
    }

    /// `key` is attached to lease `id`: nobody moved it to a lease of
    /// their own since this process wrote or read it.
    pub fn leased(key: &[u8], id: i64) -> Compare {
        Compare {
            key: key.to_vec(),
            target: Target::Lease,
            revision: id,
            value: Vec::new(),
        }
    }

    pub fn json(&self) -> Value {
        let (target, field, operand) = match self.target {
            Target::Create => (
                "CREATE",
                "create_revision",
                json!(self.revision.to_string()),
            ),
            Target::Mod => ("MOD", "mod_revision", json!(self.revision.to_string())),
            Target::Value => ("VALUE", "value", json!(b64(&self.value))),
            Target::Lease => ("LEASE", "lease", json!(self.revision.to_string())),
        };
        json!({
            "key": b64(&self.key),
            "target": target,
            "result": "EQUAL",
            field: operand,
        })
    }
}

/// An operation of a transaction's branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Writes `value` to `key`, attached to `lease` (0: none).
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
    },
    /// Reads `key`.
    Get { key: Vec<u8> },
    /// Reads the key under `prefix` created first, and how many there are
    /// (a lock queue's head and length).
    First { prefix: Vec<u8> },
    /// Deletes `key`.
    Delete { key: Vec<u8> },
}

impl Op {
    pub fn json(&self) -> Value {
        match self {
            Op::Put { key, value, lease } => {
                let mut put = json!({"key": b64(key), "value": b64(value)});
                if *lease != 0 {
                    put["lease"] = json!(lease.to_string());
                }
                json!({ "request_put": put })
            }
            Op::Get { key } => json!({"request_range": {"key": b64(key)}}),
            Op::First { prefix } => json!({"request_range": first_of(prefix)}),
            Op::Delete { key } => json!({"request_delete_range": {"key": b64(key)}}),
        }
    }
}

/// A range request for the key under `prefix` with the lowest creation
/// revision (its `count` says how many keys are under it).
pub fn first_of(prefix: &[u8]) -> Value {
    json!({
        "key": b64(prefix),
        "range_end": b64(&prefix_end(prefix)),
        "sort_order": "ASCEND",
        "sort_target": "CREATE",
        "limit": "1",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_end_past_their_last_key() {
        assert_eq!(prefix_end(b"a/"), b"a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn answers_parse_with_fields_left_out_and_numbers_as_strings() {
        // Lease ids are decimal int64 strings; anything else is refused.
        assert!(serde_json::from_str::<RangeResponse>(
            r#"{"kvs":[{"key":"Zm9v","lease":"694d7c5f4b7ad20b"}]}"#
        )
        .is_err());
        let r: RangeResponse = serde_json::from_str(
            r#"{"header":{"revision":"7","raft_term":"2"},"kvs":[{"key":"Zm9v","create_revision":"5","mod_revision":"6","version":"2","value":"YmFy","lease":"7587869"}],"count":"1"}"#,
        )
        .unwrap();
        assert_eq!(r.header.revision, 7);
        assert_eq!(r.kvs[0].key, b"foo");
        assert_eq!(r.kvs[0].value, b"bar");
        assert_eq!((r.kvs[0].create_revision, r.kvs[0].lease), (5, 7_587_869));
        let empty: RangeResponse = serde_json::from_str(r#"{"header":{}}"#).unwrap();
        assert_eq!((empty.count, empty.kvs.len()), (0, 0));
        let t: TxnResponse = serde_json::from_str(
            r#"{"header":{"revision":"9"},"succeeded":true,"responses":[{"response_put":{"header":{"revision":"9"}}}]}"#,
        )
        .unwrap();
        assert!(t.succeeded);
        assert!(matches!(t.responses[0], OpResponse::Put(_)));
        let w: WatchResponse = serde_json::from_str(
            r#"{"header":{"revision":"4"},"events":[{"type":"DELETE","kv":{"key":"Zm9v","mod_revision":"4"}}]}"#,
        )
        .unwrap();
        assert_eq!(w.events[0].kind, EventType::Delete);
        let k: KeepAliveResponse = serde_json::from_str(r#"{"header":{},"ID":"12345"}"#).unwrap();
        assert_eq!((k.id, k.ttl), (12_345, 0), "a gone lease: no TTL");
        let t: LeaseTimeToLiveResponse =
            serde_json::from_str(r#"{"header":{},"ID":"7","TTL":"3","grantedTTL":"4"}"#).unwrap();
        assert_eq!((t.id, t.ttl, t.granted_ttl), (7, 3, 4));
    }

    #[test]
    fn transactions_say_what_the_gateway_expects() {
        assert_eq!(
            Compare::absent(b"k").json(),
            json!({"key": "aw==", "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
        );
        assert_eq!(
            Compare::leased(b"k", 7).json(),
            json!({"key": "aw==", "target": "LEASE", "result": "EQUAL", "lease": "7"})
        );
        assert_eq!(
            Op::Put {
                key: b"k".to_vec(),
                value: b"v".to_vec(),
                lease: 42
            }
            .json(),
            json!({"request_put": {"key": "aw==", "value": "dg==", "lease": "42"}})
        );
    }
}
