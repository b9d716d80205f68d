//! The test MariaDB launcher does what the fault tests rely on: a private
//! server whose acknowledged commits survive `kill -9`, and whose pause
//! really stops it answering.

mod common;

use std::time::{Duration, Instant};

use common::mariadb::MariaDb;

#[test]
fn a_private_server_survives_kill_and_pauses_for_real() {
    let mut db = MariaDb::start();
    assert_ne!(db.port, 3306, "never the machine's own server");
    db.sql("CREATE TABLE t (id INT PRIMARY KEY, v INT) ENGINE=InnoDB");
    db.sql("INSERT INTO t VALUES (1, 42)");
    db.kill();
    db.restart();
    assert_eq!(db.sql("SELECT v FROM t WHERE id = 1").trim(), "42");

    db.pause();
    let sock = db.socket();
    let t = std::thread::spawn(move || {
        let started = Instant::now();
        let out = std::process::Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", sock.display()))
            .args(["-uroot", "-N", "-e", "SELECT 7"])
            .output()
            .unwrap();
        (
            started.elapsed(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    });
    std::thread::sleep(Duration::from_millis(800));
    db.resume();
    let (took, out) = t.join().unwrap();
    assert!(
        took >= Duration::from_millis(700),
        "answered while paused ({took:?})"
    );
    assert_eq!(out.trim(), "7");
}
