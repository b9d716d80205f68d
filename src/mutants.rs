//! Deliberately broken behaviours, for the fault suite's mutation proof.
//!
//! A fault suite that never failed proves little. Each mutant switches one
//! safety mechanism off (or puts back a defect fixed earlier), and the
//! suite must turn red with it (`tests/faults/`, `docs/faults.md`). A mutant
//! is switched on with `FENCER_MUTANT=<name>[,<name>…]` in the environment —
//! **only in debug builds** (the binary the tests build): in a release build
//! [`active`] is a constant `false` and every mutant branch compiles away,
//! so no production binary can be talked out of its guarantees.

/// Every mutant, with the mechanism it switches off.
pub const ALL: &[(&str, &str)] = &[
    ("etcd_token_per_place", "the etcd backend's token is the holder place's version (1 for a new place) plus the offset — a count that starts over with every place — not its creation revision"),
    ("etcd_token_ignores_offset", "the etcd backend's token is the place's creation revision alone: a raised token offset (repair, pre-registration after a restore) is not added"),
    ("etcd_early_expiry", "the etcd backend ends a held place at half its TTL, before the holder's local deadline"),
    ("etcd_waiter_place_left", "an etcd waiter that gives up leaves its place in the key's queue (it lapses only with its etcd lease)"),
    ("etcd_stamp_early", "the etcd fence store lets a waiting replica clear another's in-flight stamp at once, not after its hold"),
    ("etcd_mark_blind_write", "the etcd fence store writes a mark without comparing it with the one it decided on (no compare-and-swap)"),
    ("read_token_writes", "the gateway forwards a write carrying a read lease's token"),
    ("readers_unfenced", "the gateway admits a read lease's token at or below the write mark (a reader a writer followed)"),
    ("writers_ignore_readers", "the gateway holds a write lease's token to the write mark only, not to readers' tokens"),
    ("readers_ignore_writers", "a writer waiting for readers to leave does not keep new readers out (no writer preference): a steady stream of readers starves it (on ZooKeeper only a holding writer keeps a reader out)"),
    ("read_attempt_not_voided", "the SQL backends' undo of a read acquire whose caller gave up does nothing: a late try (PostgreSQL) or a late answer (MySQL) leaves a reader nobody holds, keeping writers out for its TTL"),
    ("writers_skip_readers", "the PostgreSQL backend grants a write lease while read leases hold the key; the ZooKeeper backend lets a writer wait only for write nodes ahead of it"),
    ("unfenced_reads", "the gateway forwards token-bearing reads unchecked: reads no longer advance the mark"),
    ("check_then_forward", "the gateway gives up the key right after the check, before the forward"),
    ("guard_in_request", "the gateway's hold on the key lives in the client's request future (dropped on disconnect)"),
    ("skip_signature", "the gateway trusts a token's claims without verifying its signature"),
    ("equal_token_any_lease", "the gateway accepts an equal token from any lease"),
    ("ignore_sequence", "the gateway ignores Fencing-Seq"),
    ("stamp_never_cleared", "the gateway never clears a key's in-flight stamp"),
    ("marks_in_memory", "the gateway keeps its marks in memory whatever its configured store"),
    ("inject_after_deadline", "the proxy injects a lease's token without checking its local deadline"),
    ("no_lease_binding", "the proxy stamps the key's current lease on writes bound to another lease"),
    ("renew_keeps_old_deadline", "a renewal keeps the larger of the old and new local deadlines"),
    ("no_repair", "the sidecar hands out a token the gateway reported stale instead of repairing forward"),
    ("keep_orphans", "an acquire that does not hand its lease over leaves it in the backend"),
    ("subscribe_without_timeout", "a waiter's subscribe has no timeout"),
    ("no_failover_reverify", "after a Redis failover the sidecar keeps every lease without checking the new master"),
    ("sentinel_resolve_once", "sentinel mode resolves the master once and never follows a failover (redis-rs's own behaviour)"),
    ("ignore_wait_shortfall", "an acquire or renewal is granted however few replicas WAIT counted"),
    ("redlock_no_quarantine", "RedLock masters vote at once after a restart, whatever backend.redlock.restart_quarantine_ms says"),
    ("zk_early_expiry", "the ZooKeeper backend deletes a held node at half its TTL, before the holder's local deadline"),
    ("zk_ttl_past_session", "the ZooKeeper backend grants leases longer than its session can keep safe"),
    ("mysql_early_expiry", "the MySQL backend writes a lease row's expiry at half its TTL, before the holder's local deadline"),
    ("zk_waiter_node_left", "a ZooKeeper waiter that gives up leaves its node in the key's queue"),
    ("undo_by_lease", "the SQL backends' compensation of an abandoned acquire releases the lease whatever attempt holds it (a retry of the same lease that was answered meanwhile included), as before issue 26"),
    ("answer_after_deadline", "an acquire answers \"held\" with its full TTL even when its lease ran out before the answer (slow pre-registration or backend), as before issue 26"),
    ("release_in_request", "a release runs in the client's request future and the lease stays \"held\" locally until the backend answered: a client that disconnects mid-release leaves it held here, as before issue 26"),
    ("eviction_unchecked", "the Redis eviction check says noeviction whatever maxmemory-policy the server answers: a Redis that may evict live lock entries is used as if it could not, as before issue 26"),
    ("unknown_methods_passed", "the gateway and the proxy treat a method outside PUT, POST, PATCH, DELETE (and their read list) as a read: MOVE, PROPPATCH, a lower-case `put` pass without a token, as before issue 26"),
    ("duplicate_header_first_wins", "a Fencing-* header sent twice is not refused: the gateway and the proxy check its first value and forward every value, as before issue 26"),
    ("batch_replies_shifted", "the Redis backend answers each call of a batched acquire or release with its neighbour's reply (item i gets item i+1's status and token)"),
    ("fence_batch_replies_shifted", "a PostgreSQL group commit (the fence store's admissions and clearings, the lock backend's acquires and releases) answers each call of a shared statement with its neighbour's row (item i gets item i+1's verdict and mark, or status and token)"),
    ("pg_group_undo_skipped", "the PostgreSQL group commit does not undo an item of a shared statement whose caller gave up (timed out or dropped) before its answer: a key it took stays taken by a lease nobody was told of until its TTL"),
    ("holds_change_kept", "a reentrant lease's hold count change (a re-entry, a release of one hold) whose caller went away before the answer is kept: the key stays held after the owner's last release, or a retried release gives back two holds"),
    ("semaphore_extra_slot", "a semaphore acquire tries one slot key more than the name's permits: permits + 1 holders at once"),
    ("permits_unchecked", "a semaphore acquire with another permit count than the one fixed for the name is not refused: users counting different slots let more holders in than the smaller count"),
    ("multi_keys_kept", "a multi-key acquire that ends without its answer (a key stayed held past wait_ms, or its client went away mid-way) keeps the keys it took until their TTL instead of giving them back"),
    ("fresh_send_time", "as before issue 10: one lease id for every try of an acquire, each try counting the deadline from its own send time, and PostgreSQL statements whose caller gave up neither bounded by the server, cancelled nor compensated"),
];

#[cfg(debug_assertions)]
static ACTIVE: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
    let names: Vec<String> = std::env::var("FENCER_MUTANT")
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    for n in &names {
        if ALL.iter().any(|(m, _)| m == n) {
            tracing::warn!(mutant = %n, "MUTANT ACTIVE: a safety mechanism is switched off (fault-suite builds only)");
        } else {
            tracing::error!(mutant = %n, "unknown mutant in FENCER_MUTANT");
        }
    }
    names
});

/// Whether mutant `name` is switched on (debug builds only).
#[inline]
pub fn active(name: &str) -> bool {
    #[cfg(debug_assertions)]
    {
        ACTIVE.iter().any(|m| m == name)
    }
    #[cfg(not(debug_assertions))]
    {
        let _ = name;
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_are_unique() {
        let mut names: Vec<&str> = super::ALL.iter().map(|(n, _)| *n).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), super::ALL.len());
    }
}
