//! Reentrant leases' hold counts on ZooKeeper.
//!
//! A key's count lives in one ephemeral node beside its queue, `holds`
//! (a name no queue node has), written by the holder's session only:
//! `<lease id> <holds> <change id> <owner>`. A record of another lease —
//! an earlier holder's, left by a session that died before it could delete
//! it — counts as none: a new lease starts from one hold, as on the other
//! backends. Changes are compare-and-set on the node's version; the node
//! dies with the session, as the lock node does, and a release deletes it
//! at the version it read (never a newer holder's record).

/// The node's name under the key's directory.
pub const NODE: &str = "holds";

/// One count record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub lease: String,
    pub holds: u32,
    pub op: String,
    pub owner: String,
}

impl Record {
    pub fn encode(lease: &str, holds: u32, op: &str, owner: &str) -> String {
        format!("{lease} {holds} {op} {owner}")
    }

    pub fn parse(data: &[u8]) -> Option<Record> {
        let text = std::str::from_utf8(data).ok()?;
        let mut fields = text.splitn(4, ' ');
        Some(Record {
            lease: fields.next()?.to_owned(),
            holds: fields.next()?.parse().ok()?,
            op: fields.next()?.to_owned(),
            owner: fields.next().unwrap_or("").to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_with_spaces_in_the_owner() {
        let text = Record::encode("L1", 3, "op-7", "billing job 2");
        assert_eq!(
            Record::parse(text.as_bytes()),
            Some(Record {
                lease: "L1".into(),
                holds: 3,
                op: "op-7".into(),
                owner: "billing job 2".into()
            })
        );
        assert_eq!(Record::parse(b"L1 x op o"), None);
    }
}
