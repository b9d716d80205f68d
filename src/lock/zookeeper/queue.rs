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
//!
//! **Readers** (read-write locks) queue in the same container, with a
//! ticket that says so ([`read_ticket`]: `r` and 16 hex digits, a name no
//! write ticket has). Curator's read-write lock: a writer holds when its
//! node is the lowest, a reader when no *write* node is below its own.
//! So readers share, a writer waits for every node ahead of it, and a
//! reader that queues behind a waiting writer waits for it too (writer
//! preference, first come first served, with nothing to expire). A writer
//! watches the node just ahead (a reader or a writer); a reader watches
//! the nearest write node ahead: when that one goes, either it held (so
//! every node ahead of it was gone: the reader holds) or it gave up or
//! died (look again).

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

/// A fresh reader's ticket: `r` and 16 hex digits.
pub fn read_ticket() -> String {
    format!("r{}", new_ticket())
}

/// Whether the queue node (or ticket) `name` is a reader's. A node of a
/// fencer without read-write locks is a writer's, as it takes the key
/// alone.
pub fn is_read_node(name: &str) -> bool {
    name.starts_with('r')
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
    /// Holds the key: the lowest sequence, or a reader with no write node
    /// ahead.
    First { name: String },
    /// Waits for `predecessor`: the node just ahead (a writer's), the
    /// nearest write node ahead (a reader's); `first`: the predecessor is
    /// the lowest node, the holder (its lock-delay is the key's).
    Behind {
        name: String,
        predecessor: String,
        first: bool,
    },
}

/// Finds `ticket`'s node among `children` and whether it holds (a
/// reader's ticket by the readers' rule, see the module doc). Should a
/// lost create have been retried into two nodes of one ticket, the lowest
/// counts and `extra` lists the others, to be deleted.
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
    let ahead = &queue[..index];
    let waits_for = if !is_read_node(ticket) {
        // A writer waits for whatever is just ahead.
        let skip_readers = crate::mutants::active("writers_skip_readers");
        ahead
            .iter()
            .rev()
            .find(|(_, c)| !skip_readers || !is_read_node(c))
    } else if crate::mutants::active("readers_ignore_writers") {
        // No writer preference: only a writer that holds keeps it out.
        ahead.first().filter(|(_, c)| !is_read_node(c))
    } else {
        ahead.iter().rev().find(|(_, c)| !is_read_node(c))
    };
    let place = match waits_for {
        None => Place::First {
            name: (*name).clone(),
        },
        Some((_, predecessor)) => Place::Behind {
            name: (*name).clone(),
            predecessor: (*predecessor).clone(),
            first: *predecessor == queue[0].1,
        },
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
                predecessor: "ccc-0000000011".into(),
                first: false
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
                predecessor: "t2-0000000001".into(),
                first: true
            }
        );
        assert_eq!(extra, vec!["t1-0000000005".to_string()]);
    }

    #[test]
    fn readers_share_and_wait_only_for_writers_ahead() {
        let (w1, r1, r2, w2, r3) = (
            "0000000000000001-0000000001",
            "r0000000000000002-0000000002",
            "r0000000000000003-0000000003",
            "0000000000000004-0000000004",
            "r0000000000000005-0000000005",
        );
        let queue = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let all = queue(&[r3, w2, r2, r1, w1]);
        let behind = |name: &str, predecessor: &str| Place::Behind {
            name: name.into(),
            predecessor: predecessor.into(),
            first: predecessor == w1,
        };
        // Behind a writer that holds, every reader waits for it.
        assert_eq!(place(&all, "r0000000000000002").0, behind(r1, w1));
        assert_eq!(place(&all, "r0000000000000003").0, behind(r2, w1));
        // A writer waits for the reader just ahead; a reader queued
        // behind a waiting writer waits for that writer (no starvation).
        assert_eq!(place(&all, "0000000000000004").0, behind(w2, r2));
        assert_eq!(place(&all, "r0000000000000005").0, behind(r3, w2));
        // With the writer gone, the readers ahead of the other writer hold
        // together; the one behind it still waits.
        let rest = queue(&[r3, w2, r2, r1]);
        for (ticket, name) in [("r0000000000000002", r1), ("r0000000000000003", r2)] {
            assert_eq!(place(&rest, ticket).0, Place::First { name: name.into() });
        }
        assert_eq!(place(&rest, "r0000000000000005").0, behind(r3, w2));
        assert!(is_read_node(&read_ticket()) && !is_read_node(&new_ticket()));
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
