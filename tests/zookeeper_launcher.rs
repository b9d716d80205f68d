//! Self-test of the ZooKeeper launchers (`tests/common/zookeeper.rs`): a
//! standalone server survives kill -9 and restart with its data, and a
//! 3-member ensemble elects a new leader (in a new epoch) when its leader is
//! killed and takes the old leader back. Prints the times it measured
//! (`--nocapture` to see them).

mod common;

use std::time::{Duration, Instant};

use common::zookeeper::{zk_cli, ZooKeeperEnsemble, ZooKeeperServer};

/// `zkCli get <path>` on `connect`: the znode's data, or the failure.
fn cli_get(connect: &str, path: &str) -> String {
    let out = zk_cli(connect, &["get", path]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn cli_create(connect: &str, path: &str, data: &str) {
    let out = zk_cli(connect, &["create", path, data]);
    assert!(
        out.status.success(),
        "zkCli create {path}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn standalone_survives_kill_and_restart_with_its_data() {
    let t = Instant::now();
    let mut zk = ZooKeeperServer::start();
    eprintln!(
        "standalone up in {:?} at {}",
        t.elapsed(),
        zk.connect_string()
    );
    assert_eq!(zk.connect_string(), format!("127.0.0.1:{}", zk.port));
    assert_eq!(zk.srvr().unwrap().mode.as_deref(), Some("standalone"));

    cli_create(&zk.connect_string(), "/launcher", "kept");
    let before = zk.zxid();
    assert!(before > 0, "a write must move the zxid");

    zk.pause();
    assert_eq!(zk.srvr(), None, "a paused server answers nothing");
    zk.resume();
    assert_eq!(zk.srvr().unwrap().mode.as_deref(), Some("standalone"));

    let pid = zk.pid();
    zk.kill();
    assert!(
        common::zookeeper::four_letter(zk.port, "srvr").is_none(),
        "the port must be closed after kill -9"
    );
    let t = Instant::now();
    zk.restart();
    eprintln!("standalone restarted in {:?}", t.elapsed());
    assert_ne!(zk.pid(), pid);
    assert_eq!(zk.srvr().unwrap().mode.as_deref(), Some("standalone"));
    assert!(
        zk.zxid() >= before,
        "data dir kept: zxid {:#x} < {before:#x}",
        zk.zxid()
    );
    let got = cli_get(&zk.connect_string(), "/launcher");
    assert!(
        got.lines().any(|l| l == "kept"),
        "znode lost across restart: {got}"
    );
}

#[test]
fn ensemble_elects_a_new_leader_in_a_new_epoch_and_takes_the_old_back() {
    let t = Instant::now();
    let mut zk = ZooKeeperEnsemble::start();
    eprintln!(
        "3-member ensemble up in {:?} at {}",
        t.elapsed(),
        zk.connect_string()
    );
    assert_eq!(zk.connect_string().split(',').count(), 3);
    assert!(zk.is_healthy(), "modes {:?}", zk.modes());

    cli_create(&zk.connect_string(), "/launcher", "kept");
    let old = zk.leader();
    let before = zk.zxid(old);

    let (killed, t_kill) = zk.kill_leader();
    assert_eq!(killed, old);
    let new = zk.wait_new_leader(old, Duration::from_secs(15));
    eprintln!(
        "new leader zk-{} elected {:?} after kill -9 of zk-{}",
        new + 1,
        t_kill.elapsed(),
        old + 1
    );
    assert_ne!(new, old);
    let after = zk.zxid(new);
    assert!(
        after >> 32 > before >> 32,
        "epoch must go up: {before:#x} -> {after:#x}"
    );
    let other = (0..3).find(|&i| i != old && i != new).unwrap();
    assert_eq!(zk.mode(other).as_deref(), Some("follower"));

    let t = Instant::now();
    zk.restart(old);
    zk.wait_healthy(Duration::from_secs(15));
    eprintln!("old leader back, ensemble healthy in {:?}", t.elapsed());
    assert_eq!(zk.mode(old).as_deref(), Some("follower"));
    assert_eq!(zk.try_leader(), Some(new));
    // The restarted member still has the znode (its own port only).
    let got = cli_get(&format!("127.0.0.1:{}", zk.ports()[old]), "/launcher");
    assert!(got.lines().any(|l| l == "kept"), "znode lost: {got}");

    let pids: Vec<u32> = (0..3).map(|i| zk.pid(i)).collect();
    zk.stop();
    for pid in pids {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            state.is_empty(),
            "zk pid {pid} still there after stop: {state}"
        );
    }
}
