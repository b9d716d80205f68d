//! Self-test of the etcd launcher (`tests/common/etcd.rs`, issue 34): one
//! member survives kill -9 and restart with its data, and a 3-member
//! cluster elects a new leader (in a higher term) when its leader is
//! killed and takes the old leader back, data and all. Prints the times it
//! measured (`--nocapture` to see them).

mod common;

use std::time::{Duration, Instant};

use common::etcd::{post_json, EtcdCluster};

fn b64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// `kv/put` of `key` through member port `port`; the store's revision after it.
fn put(port: u16, key: &str, value: &str) -> i64 {
    let body = format!(r#"{{"key":"{}","value":"{}"}}"#, b64(key), b64(value));
    let (code, text) = post_json(port, "/v3/kv/put", &body).expect("put answered");
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["header"]["revision"].as_str().unwrap().parse().unwrap()
}

/// `kv/range` of `key` through `port`: its value, if any.
fn get(port: u16, key: &str) -> Option<String> {
    let body = format!(r#"{{"key":"{}"}}"#, b64(key));
    let (code, text) = post_json(port, "/v3/kv/range", &body).expect("range answered");
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let value = v["kvs"][0]["value"].as_str()?;
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(value)
        .unwrap();
    Some(String::from_utf8(raw).unwrap())
}

#[test]
fn one_member_survives_kill_and_restart_with_its_data() {
    let t = Instant::now();
    let mut etcd = EtcdCluster::with_size(1);
    eprintln!(
        "one member up in {:?} at {:?}",
        t.elapsed(),
        etcd.endpoints()
    );
    let port = etcd.ports()[0];
    assert!(etcd.status(0).unwrap().leads());
    let revision = put(port, "launcher", "kept");
    assert!(revision > 1, "a write moves the revision");

    etcd.pause(0);
    assert_eq!(etcd.status(0), None, "a paused member answers nothing");
    etcd.resume(0);
    assert!(etcd.status(0).is_some());

    let pid = etcd.pid(0);
    etcd.kill(0);
    assert!(post_json(port, "/v3/maintenance/status", "{}").is_none());
    let t = Instant::now();
    etcd.restart(0);
    eprintln!("restarted in {:?}", t.elapsed());
    assert_ne!(etcd.pid(0), pid);
    assert_eq!(get(port, "launcher").as_deref(), Some("kept"));
    assert!(etcd.status(0).unwrap().revision >= revision);
}

#[test]
fn a_cluster_elects_a_new_leader_in_a_higher_term_and_takes_the_old_back() {
    let t = Instant::now();
    let mut etcd = EtcdCluster::start();
    eprintln!(
        "3 members up in {:?} at {:?}",
        t.elapsed(),
        etcd.endpoints()
    );
    assert!(etcd.is_healthy());
    let ports = etcd.ports();
    let old = etcd.leader();
    put(ports[old], "launcher", "kept");
    let term = etcd.status(old).unwrap().raft_term;

    let (killed, at) = etcd.kill_leader();
    assert_eq!(killed, old);
    let new = etcd.wait_new_leader(old, Duration::from_secs(15));
    eprintln!(
        "new leader m{new} {:?} after kill -9 of m{old}",
        at.elapsed()
    );
    assert!(etcd.status(new).unwrap().raft_term > term);
    let other = (0..3).find(|&i| i != old && i != new).unwrap();
    assert_eq!(get(ports[other], "launcher").as_deref(), Some("kept"));

    let t = Instant::now();
    etcd.restart(old);
    etcd.wait_healthy(Duration::from_secs(15));
    eprintln!("old leader back, cluster healthy in {:?}", t.elapsed());
    assert_eq!(etcd.try_leader(), Some(new));
    assert_eq!(get(ports[old], "launcher").as_deref(), Some("kept"));

    let pids: Vec<u32> = (0..3).map(|i| etcd.pid(i)).collect();
    etcd.stop();
    for pid in pids {
        assert!(
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_err(),
            "etcd pid {pid} still there after stop"
        );
    }
}
