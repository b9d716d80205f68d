//! The lock queue's shape in ZooKeeper: one container node per key, one
//! ephemeral-sequential node per contender, lowest sequence holds.
//!
//! ```text
//! <root>/locks/k-<escaped key>/<ticket>-0000000042
//! ```
//!
//! The *ticket* is random per queue entry and written into the node's name
//! before the sequence number, so a create whose reply was lost can be
//! found again by listing the children (Curator's "protected" mode) instead
//! of queueing a second node. Waiters watch only their predecessor, so a
//! release wakes one sidecar, not every one (no herd).

use rand::Rng;

/// The container node for `key`'s queue. Keys are escaped so any key (its
/// `/`, `.`, spaces, non-ASCII) is one valid node name.
pub fn key_dir(locks_dir: &str, key: &str) -> String {
    let mut out = String::with_capacity(locks_dir.len() + 3 + key.len());
    out.push_str(locks_dir);
    out.push_str("/k-");
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(
                char::from_digit(u32::from(b >> 4), 16)
                    .expect("nibble")
                    .to_ascii_uppercase(),
            );
            out.push(
                char::from_digit(u32::from(b & 15), 16)
                    .expect("nibble")
                    .to_ascii_uppercase(),
            );
        }
    }
    out
}

/// A fresh ticket: 16 hex digits, unique per queue entry.
pub fn new_ticket() -> String {
    format!("{:016x}", rand::rng().random::<u64>())
}

/// The path to create (ZooKeeper appends the sequence number).
pub fn node_prefix(dir: &str, ticket: &str) -> String {
    format!("{dir}/{ticket}-")
}

/// The sequence number of a child named `<ticket>-<10 digits>`.
pub fn sequence(name: &str) -> Option<u64> {
    let (_, seq) = name.rsplit_once('-')?;
    (seq.len() >= 10).then_some(())?;
    seq.parse().ok()
}

/// Where `ticket` stands in the queue `children` (names as listed).
#[derive(Debug, PartialEq, Eq)]
pub enum Place {
    /// No node of this ticket: never created, or gone with its session.
    Absent,
    /// Lowest sequence: the holder.
    First { name: String },
    /// Behind `predecessor`, the node just ahead.
    Behind { name: String, predecessor: String },
}

/// Finds `ticket`'s node among `children`. Should a lost create have
/// been retried into two nodes of one ticket, the lowest counts and
/// `extra` lists the others, to be deleted.
pub fn place(children: &[String], ticket: &str) -> (Place, Vec<String>) {
    let mut queue: Vec<(u64, &String)> = children
        .iter()
        .filter_map(|c| sequence(c).map(|s| (s, c)))
        .collect();
    queue.sort_unstable();
    let mine = |c: &String| c.rsplit_once('-').is_some_and(|(t, _)| t == ticket);
    let mut found = queue.iter().enumerate().filter(|(_, (_, c))| mine(c));
    let Some((index, (_, name))) = found.next() else {
        return (Place::Absent, Vec::new());
    };
    let extra = found.map(|(_, (_, c))| (*c).clone()).collect();
    let place = if index == 0 {
        Place::First {
            name: (*name).clone(),
        }
    } else {
        Place::Behind {
            name: (*name).clone(),
            predecessor: queue[index - 1].1.clone(),
        }
    };
    (place, extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_key_is_one_node_name() {
        assert_eq!(key_dir("/f/locks", "acct:1"), "/f/locks/k-acct%3A1");
        assert_eq!(key_dir("/f/locks", "a/../b"), "/f/locks/k-a%2F%2E%2E%2Fb");
        assert_eq!(key_dir("/f/locks", "ä b"), "/f/locks/k-%C3%A4%20b");
        // Distinct keys, distinct nodes (escaping is injective).
        assert_ne!(key_dir("/l", "a%2F"), key_dir("/l", "a/"));
    }

    #[test]
    fn the_lowest_sequence_holds_whatever_the_listing_order() {
        let children: Vec<String> = ["bbb-0000000012", "aaa-0000000010", "ccc-0000000011"]
            .map(String::from)
            .to_vec();
        assert_eq!(
            place(&children, "aaa").0,
            Place::First {
                name: "aaa-0000000010".into()
            }
        );
        assert_eq!(
            place(&children, "bbb").0,
            Place::Behind {
                name: "bbb-0000000012".into(),
                predecessor: "ccc-0000000011".into()
            }
        );
        assert_eq!(place(&children, "ddd").0, Place::Absent);
    }

    #[test]
    fn a_ticket_queued_twice_keeps_its_first_node() {
        let children: Vec<String> = ["t1-0000000003", "t2-0000000001", "t1-0000000005", "junk"]
            .map(String::from)
            .to_vec();
        let (p, extra) = place(&children, "t1");
        assert_eq!(
            p,
            Place::Behind {
                name: "t1-0000000003".into(),
                predecessor: "t2-0000000001".into()
            }
        );
        assert_eq!(extra, vec!["t1-0000000005".to_string()]);
    }

    #[test]
    fn sequences_past_the_tenth_digit_still_order() {
        // ZooKeeper's counter is a signed 32-bit int printed with %010d;
        // past 2^31 it wraps negative, which `sequence` refuses rather than
        // misorders (a key would need 2^31 queue entries first).
        assert_eq!(sequence("t-2147483647"), Some(2_147_483_647));
        assert_eq!(sequence("t--000000001"), None);
        assert_eq!(sequence("t-12"), None);
    }
}
