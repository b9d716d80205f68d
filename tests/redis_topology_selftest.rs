//! Self-test of the Redis topology harness (`tests/common/redis_topology.rs`):
//! a Sentinel set and a Redis Cluster start, replicate and fail over, and a
//! frozen replication link loses the writes it holds across a failover.
//! Prints the times it measured (`--nocapture` to see them).

mod common;

use std::time::{Duration, Instant};

use common::redis_topology::{ClusterSet, SentinelOpts, SentinelSet};

fn info_field(conn: &mut redis::Connection, field: &str) -> String {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query(conn)
        .unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sentinel_set_replicates_and_fails_over() {
    let t = Instant::now();
    let mut set = SentinelSet::start(SentinelOpts::default());
    eprintln!(
        "sentinel set (1+2 nodes, 3 sentinels) ready in {:?}",
        t.elapsed()
    );
    assert_eq!(set.master_name(), "fencer-test");
    assert_eq!(set.sentinel_addrs().len(), 3);
    assert!(set.sentinels_toml().starts_with("[\"127.0.0.1:"));
    assert_eq!(set.node_ports().len(), 3);

    let master = set.master_port();
    assert_eq!(master, set.node_ports()[0]);
    let mut m = set.node_conn(master);
    let _: () = redis::cmd("SET").arg("k").arg("v1").query(&mut m).unwrap();
    for port in set.node_ports().into_iter().filter(|&p| p != master) {
        let mut r = set.node_conn(port);
        eventually("the write on every replica", Duration::from_secs(5), || {
            redis::cmd("GET")
                .arg("k")
                .query::<Option<String>>(&mut r)
                .unwrap()
                == Some("v1".into())
        });
    }

    let old = set.kill_master();
    assert_eq!(old, master);
    let t = Instant::now();
    let new = set.wait_new_master(old, Duration::from_secs(12));
    eprintln!("sentinel failover: {old} -> {new} in {:?}", t.elapsed());
    assert_ne!(new, old);
    let mut n = set.node_conn(new);
    let v: Option<String> = redis::cmd("GET").arg("k").query(&mut n).unwrap();
    assert_eq!(v.as_deref(), Some("v1"));
    let _: () = redis::cmd("SET").arg("k").arg("v2").query(&mut n).unwrap();

    // The old master comes back empty and becomes a replica of the new one.
    // A fresh connection each time: the sentinels' reconfiguration ends
    // with CLIENT KILL TYPE normal.
    let t = Instant::now();
    set.restart_node(old);
    eventually(
        "the old master to rejoin as a replica",
        Duration::from_secs(15),
        || {
            let Ok(mut o) = redis::Client::open(format!("redis://127.0.0.1:{old}"))
                .unwrap()
                .get_connection()
            else {
                return false;
            };
            info_field(&mut o, "role") == "slave"
                && info_field(&mut o, "master_link_status") == "up"
                && redis::cmd("GET")
                    .arg("k")
                    .query::<Option<String>>(&mut o)
                    .ok()
                    == Some(Some("v2".into()))
        },
    );
    eprintln!("old master rejoined as a replica in {:?}", t.elapsed());

    // A manual failover moves the master again.
    let t = Instant::now();
    set.failover();
    let third = set.wait_new_master(new, Duration::from_secs(12));
    eprintln!("manual failover: {new} -> {third} in {:?}", t.elapsed());
}

#[test]
fn frozen_replication_holds_writes_and_loses_them_in_a_failover() {
    let t = Instant::now();
    let mut set = SentinelSet::start(SentinelOpts {
        relay_replication: true,
        // Short, to check that the sentinels do not re-point the replicas
        // around the relay once it has passed (`+fix-slave-config`).
        failover_timeout_ms: 2000,
        ..SentinelOpts::default()
    });
    eprintln!("relayed sentinel set ready in {:?}", t.elapsed());
    let relay = set.relay_port().unwrap();
    let master = set.master_port();
    assert_eq!(master, set.node_ports()[0]);
    std::thread::sleep(Duration::from_millis(2500));
    for port in set.node_ports().into_iter().filter(|&p| p != master) {
        let mut r = set.node_conn(port);
        assert_eq!(
            info_field(&mut r, "master_port"),
            relay.to_string(),
            "replica {port} no longer replicates through the relay\n{}",
            set.logs()
        );
    }

    let mut m = set.node_conn(master);
    set.freeze_replication();
    let _: i64 = redis::cmd("INCR").arg("n").query(&mut m).unwrap();
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(200).query(&mut m).unwrap();
    assert_eq!(acked, 0, "a replica acknowledged through a frozen link");
    set.thaw_replication();
    let t = Instant::now();
    eventually(
        "a replica to acknowledge after the thaw",
        Duration::from_secs(5),
        || {
            redis::cmd("WAIT")
                .arg(1)
                .arg(500)
                .query::<i64>(&mut m)
                .unwrap()
                >= 1
        },
    );
    eprintln!("acknowledged {:?} after the thaw", t.elapsed());
    // No failover happened while the link was frozen.
    assert_eq!(set.master_port(), master);

    // The lossy failover recipe.
    set.freeze_replication();
    let _: () = redis::cmd("SET")
        .arg("lost")
        .arg("1")
        .query(&mut m)
        .unwrap();
    let old = set.kill_master();
    let t = Instant::now();
    let new = set.wait_new_master(old, Duration::from_secs(12));
    eprintln!("lossy failover: {old} -> {new} in {:?}", t.elapsed());
    let mut n = set.node_conn(new);
    let lost: Option<String> = redis::cmd("GET").arg("lost").query(&mut n).unwrap();
    assert_eq!(lost, None, "the frozen write reached the promoted replica");
    let kept: Option<i64> = redis::cmd("GET").arg("n").query(&mut n).unwrap();
    assert_eq!(kept, Some(1));
}

#[test]
fn cluster_starts_hashes_slots_and_fails_over() {
    let t = Instant::now();
    let mut cluster = ClusterSet::start(3, 1);
    eprintln!("cluster 3+3 ready in {:?}", t.elapsed());
    assert_eq!(cluster.node_urls().len(), 6);
    assert!(cluster.nodes_toml().starts_with("[\"redis://127.0.0.1:"));

    let first = cluster.node_ports()[0];
    let mut c = cluster.conn(first);
    let mut keys: Vec<String> = [
        "{a}b", "a{}b", "{", "}", "{}", "x{y}z{w}", "{{a}}", "a{b", "", "é",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    keys.extend((0..40).map(|i| format!("fencer:lock:{i}:{}", i * 7919)));
    for k in &keys {
        let want: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(k)
            .query(&mut c)
            .unwrap();
        assert_eq!(ClusterSet::slot_of(k), want, "slot of {k:?}");
    }

    let key = "fencer:{lock}:x";
    let slot = ClusterSet::slot_of(key);
    let old = cluster.master_port_for_slot(slot);
    let mut m = cluster.conn(old);
    let _: () = redis::cmd("SET").arg(key).arg("1").query(&mut m).unwrap();
    let _: i64 = redis::cmd("WAIT").arg(1).arg(2000).query(&mut m).unwrap();

    cluster.kill_node(old);
    let t = Instant::now();
    let new = cluster.wait_slot_master_change(slot, old, Duration::from_secs(15));
    eprintln!(
        "cluster failover of slot {slot}: {old} -> {new} in {:?}",
        t.elapsed()
    );
    let mut n = cluster.conn(new);
    let v: Option<String> = redis::cmd("GET").arg(key).query(&mut n).unwrap();
    assert_eq!(v.as_deref(), Some("1"));

    let t = Instant::now();
    cluster.restart_node(old);
    cluster.wait_ok(Duration::from_secs(20));
    assert_eq!(cluster.is_replica(old), Some(true));
    assert_eq!(cluster.master_port_for_slot(slot), new);
    eprintln!("old master rejoined as a replica in {:?}", t.elapsed());
}
