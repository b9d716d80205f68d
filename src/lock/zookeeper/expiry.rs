//! A lease's end on the ensemble's clock, so that a dead sidecar's nodes do
//! not block its keys until its *session* expires.
//!
//! Ephemeral nodes have no TTL: a node lives as long as its session, and a
//! sidecar killed with `kill -9` keeps its session — and every node of it,
//! holding or waiting — for the whole session timeout. So every lock node
//! carries a *lease-expiry record*: its data says how long it may live
//! without being written (`life`, ms), and its `mtime` — assigned by the
//! leader when the write commits — says since when. The holder refreshes
//! its node with every renewal (a `setData`), a waiter refreshes its queue
//! node every `life / 4` (keepalive). A node not written for `life` is dead
//! on the ensemble's clock, and its successor in the queue deletes it:
//!
//! - The successor learns the ensemble's current time from the `mtime` of a
//!   write of its own (its keepalive of its own node): a time the leader
//!   stamped at or before the delete that follows.
//! - The delete names the version the successor read with that `mtime`, so
//!   a refresh that commits first wins (the delete fails `BadVersion`), and
//!   a refresh that comes after the delete finds no node (the holder's
//!   renewal answers `lease_lost`).
//! - Both `mtime`s come from the leader's wall clock. Within one epoch (the
//!   zxid's high 32 bits) it is one leader's clock; across a leader change
//!   two clocks are compared, so the check adds `leader_clock_skew_ms`.
//!
//! Why this is safe for a live holder: a holder node's `life` is its
//! lease's TTL plus the lock-delay, counted from a write sent after the
//! holder's send time, while the holder's own deadline is `send + ttl ×
//! (1 − drift) − margin` — earlier. Only a step forward of the leader's wall
//! clock (not a slew) can end a lease early, as on MySQL; the gateway then
//! refuses the older holder.

use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client as zk;

/// A lock node's data: `<token offset> <lease id> <life ms> <delay ms>`,
/// the life being the lease's TTL plus `delay`, its lock-delay. Nodes
/// written by fencer before the expiry record have no third field and
/// never expire on the ensemble's clock (only with their session); before
/// the delay field, none is known (a waiter then says `lock_held` through
/// the delay, as those versions did).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeData {
    pub offset: u64,
    pub life_ms: Option<u64>,
    pub delay_ms: u64,
}

impl NodeData {
    pub fn encode(offset: u64, lease: &str, life: Duration, delay: Duration) -> String {
        format!(
            "{offset} {lease} {} {}",
            life.as_millis(),
            delay.as_millis()
        )
    }

    pub fn parse(data: &[u8]) -> Option<NodeData> {
        let text = std::str::from_utf8(data).ok()?;
        let mut fields = text.split(' ');
        let offset = fields.next()?.parse().ok()?;
        let _lease = fields.next();
        let life_ms = fields.next().and_then(|f| f.parse().ok());
        let delay_ms = fields.next().and_then(|f| f.parse().ok()).unwrap_or(0);
        Some(NodeData {
            offset,
            life_ms,
            delay_ms,
        })
    }
}

/// A time the leader stamped on a write (ms since the epoch, its wall
/// clock) and the epoch of the leader that stamped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerTime {
    pub ms: i64,
    pub epoch: i64,
}

impl ServerTime {
    /// The time of the write that `stat` describes (its last modification).
    pub fn of(stat: &zk::Stat) -> ServerTime {
        ServerTime {
            ms: stat.mtime,
            epoch: stat.mzxid >> 32,
        }
    }
}

/// A node's lease-expiry record: its last write and its life.
#[derive(Debug, Clone, Copy)]
pub struct Record {
    pub written: ServerTime,
    pub version: i32,
    pub life_ms: u64,
    /// The lock-delay at the end of the life (0: none, or not recorded).
    pub delay_ms: u64,
}

impl Record {
    pub fn of(stat: &zk::Stat, data: &[u8]) -> Option<Record> {
        let d = NodeData::parse(data)?;
        Some(Record {
            written: ServerTime::of(stat),
            version: stat.version,
            life_ms: d.life_ms?,
            delay_ms: d.delay_ms.min(d.life_ms?),
        })
    }

    /// When, on this process's clock, a holder node's lock-delay begins
    /// (its lease's TTL ran out) and ends (the node is dead), given the
    /// newest write of ours. An estimate for the answer to a waiter —
    /// `lock_delayed` rather than `lock_held` — never for a deletion.
    pub fn delay_window(
        &self,
        sample: ServerTime,
        seen: Instant,
        skew: Duration,
    ) -> (Instant, Instant) {
        let ends = self.check_at(sample, seen, skew);
        (
            ends.checked_sub(Duration::from_millis(self.delay_ms))
                .unwrap_or(ends),
            ends,
        )
    }

    /// The ensemble time after which the node is dead, as seen by a
    /// check whose own write was stamped by the leader of `epoch`.
    fn ends(&self, epoch: i64, skew: Duration) -> i64 {
        let margin = if epoch == self.written.epoch {
            0
        } else {
            skew.as_millis() as i64
        };
        self.written
            .ms
            .saturating_add(self.life_ms as i64)
            .saturating_add(margin)
    }

    /// Dead at `now` (a write of the checker's, stamped at or before the
    /// delete it would send).
    pub fn expired(&self, now: ServerTime, skew: Duration) -> bool {
        now.ms > self.ends(now.epoch, skew)
    }

    /// When, on this process's clock, the node may be dead, given the
    /// newest write of ours (`sample`, answered at `seen`). Only a guess to
    /// schedule the check; the check itself asks the ensemble again.
    pub fn check_at(&self, sample: ServerTime, seen: Instant, skew: Duration) -> Instant {
        let left = self.ends(sample.epoch, skew).saturating_sub(sample.ms) + 1;
        seen + Duration::from_millis(left.max(0) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(mtime: i64, epoch: i64, version: i32) -> zk::Stat {
        zk::Stat {
            czxid: 1,
            mzxid: (epoch << 32) | 7,
            pzxid: 1,
            ctime: mtime,
            mtime,
            version,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 1,
            data_length: 0,
            num_children: 0,
        }
    }

    #[test]
    fn data_with_and_without_a_life() {
        let d = NodeData::encode(
            12,
            "lease-a",
            Duration::from_millis(2_500),
            Duration::from_millis(500),
        );
        assert_eq!(d, "12 lease-a 2500 500");
        assert_eq!(
            NodeData::parse(d.as_bytes()),
            Some(NodeData {
                offset: 12,
                life_ms: Some(2_500),
                delay_ms: 500
            })
        );
        // Written by fencer before the record: no expiry on the ensemble;
        // before the delay field: no delay known.
        assert_eq!(
            NodeData::parse(b"0 lease-a"),
            Some(NodeData {
                offset: 0,
                life_ms: None,
                delay_ms: 0
            })
        );
        assert_eq!(NodeData::parse(b"0 lease-a 900").unwrap().delay_ms, 0);
        assert_eq!(NodeData::parse(b"x y"), None);
        assert!(Record::of(&stat(1, 1, 0), b"0 lease-a").is_none());
    }

    #[test]
    fn a_node_is_dead_only_after_its_life_on_the_leaders_clock() {
        let skew = Duration::from_millis(1_000);
        let r = Record::of(&stat(10_000, 3, 4), b"0 l 2000").unwrap();
        let at = |ms, epoch| ServerTime { ms, epoch };
        assert!(!r.expired(at(12_000, 3), skew), "exactly at its end");
        assert!(r.expired(at(12_001, 3), skew));
        // Another leader's clock: the skew margin on top.
        assert!(!r.expired(at(13_000, 4), skew));
        assert!(r.expired(at(13_001, 4), skew));
        // A check scheduled from an older sample lands just after the end.
        let seen = Instant::now();
        assert_eq!(
            r.check_at(at(11_000, 3), seen, skew),
            seen + Duration::from_millis(1_001)
        );
        assert_eq!(r.check_at(at(20_000, 3), seen, skew), seen, "already past");
    }

    #[test]
    fn a_holders_delay_is_the_end_of_its_life() {
        let skew = Duration::from_millis(1_000);
        let r = Record::of(&stat(10_000, 3, 4), b"0 l 2000 500").unwrap();
        let seen = Instant::now();
        let sample = ServerTime {
            ms: 11_000,
            epoch: 3,
        };
        assert_eq!(
            r.delay_window(sample, seen, skew),
            (
                seen + Duration::from_millis(501),
                seen + Duration::from_millis(1_001)
            )
        );
        // A delay recorded longer than the life counts as the whole life.
        let odd = Record::of(&stat(10_000, 3, 4), b"0 l 2000 9000").unwrap();
        assert_eq!(odd.delay_ms, 2_000);
    }
}
