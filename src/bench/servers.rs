//! Lock backends the `--local` benchmarks start for themselves besides
//! Redis: a private PostgreSQL (initdb in a temp dir), a private MariaDB
//! (`mariadb-install-db` in a temp dir) and a ZooKeeper ensemble, all on
//! free loopback ports, gone when dropped. None of them touches the
//! machine's own servers (PostgreSQL on 5432, MariaDB on 3306).

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::local::{self, Proc};

/// A PostgreSQL server tuned like the tests' (no fsync: the benchmark
/// measures the lock protocol, not the disk).
pub async fn postgres() -> Result<(Proc, String), String> {
    let bin = pg_bin()?;
    let run_as = if effective_uid()? == 0 {
        Some(user_ids("postgres")?)
    } else {
        None
    };
    // As root the server runs as `postgres`, which must reach its files:
    // /tmp is world-traversable whatever TMPDIR says.
    let dir = match run_as {
        Some(_) => {
            let d = PathBuf::from(format!(
                "/tmp/fencer-bench-pg-{}-{}",
                std::process::id(),
                rand::random::<u32>()
            ));
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            d
        }
        None => local::temp_dir("pg")?,
    };
    let data = dir.join("data");
    if let Some((uid, gid)) = run_as {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
    }
    let mut initdb = match run_as {
        Some(_) => {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin.join("initdb"));
            c
        }
        None => Command::new(bin.join("initdb")),
    };
    let out = initdb
        .arg("-D")
        .arg(&data)
        .args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        ])
        .current_dir(&dir)
        .output()
        .map_err(|e| format!("initdb: {e} (apt-get install postgresql)"))?;
    if !out.status.success() {
        return Err(format!(
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let port = local::free_port()?;
    let mut cmd = Command::new(bin.join("postgres"));
    cmd.arg("-D")
        .arg(&data)
        .args(["-p", &port.to_string(), "-k"])
        .arg(&dir);
    for setting in [
        "listen_addresses=127.0.0.1",
        "fsync=off",
        "full_page_writes=off",
        "synchronous_commit=off",
        "max_connections=200",
    ] {
        cmd.args(["-c", setting]);
    }
    cmd.current_dir(&dir);
    if let Some((uid, gid)) = run_as {
        cmd.uid(uid).gid(gid).env("HOME", &dir);
    }
    let mut p = local::spawn("postgres", cmd, dir)?;
    local::wait_tcp(&mut p, &format!("127.0.0.1:{port}")).await?;
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    // The port opens before logins are accepted.
    let started = Instant::now();
    loop {
        match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
            Ok(_) => return Ok((p, url)),
            Err(e) if started.elapsed() > Duration::from_secs(30) => {
                return Err(format!(
                    "postgres never accepted a login: {e}\n{}",
                    p.log_tail()
                ))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// How long a private MariaDB may take to shut down on SIGTERM before it
/// is killed.
const MARIADB_STOP_GRACE: Duration = Duration::from_secs(20);
/// How long it may take to accept a login after it was started.
const MARIADB_START_TIMEOUT: Duration = Duration::from_secs(60);

/// A private MariaDB server, tuned like the PostgreSQL one: the redo log is
/// written at commit but flushed about once a second
/// (`innodb_flush_log_at_trx_commit=2`, the analogue of `fsync=off`), no
/// binary log. `root` has no password; the URL names database `fencer`,
/// created here. Dropping the [`Proc`] stops the server (SIGTERM, then
/// SIGKILL after [`MARIADB_STOP_GRACE`]) and removes its directory.
pub async fn mariadb() -> Result<(Proc, String), String> {
    let root = effective_uid()? == 0;
    let user: &[&str] = if root { &["--user=root"] } else { &[] };
    // Below the ephemeral range, never the machine's own server's 3306.
    let port = local::free_port()?;
    if port == 3306 {
        return Err("no free port for MariaDB besides 3306".into());
    }
    // Under /tmp whatever TMPDIR says: the socket's path must stay short.
    let dir = PathBuf::from(format!(
        "/tmp/fencer-bench-mariadb-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let (data, tmp, sock) = (dir.join("data"), dir.join("tmp"), dir.join("sock"));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let install = tokio::process::Command::new("mariadb-install-db")
        .arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--tmpdir={}", tmp.display()))
        .args([
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            "--innodb-log-file-size=8M",
        ])
        .args(user)
        .current_dir(&dir)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await;
    let failed = match install {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "mariadb-install-db failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(e) => Some(format!(
            "mariadb-install-db: {e} (apt-get install mariadb-server)"
        )),
    };
    if let Some(e) = failed {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(e);
    }
    let mut cmd = Command::new("mariadbd");
    cmd.arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--port={port}"))
        .arg(format!("--socket={}", sock.display()))
        .arg(format!("--pid-file={}", dir.join("pid").display()))
        .arg(format!("--tmpdir={}", tmp.display()))
        .args([
            "--bind-address=127.0.0.1",
            "--skip-name-resolve",
            "--innodb-log-file-size=8M",
            "--innodb-buffer-pool-size=64M",
            "--max-connections=500",
            "--skip-log-bin",
            "--innodb-flush-log-at-trx-commit=2",
        ])
        .args(user)
        .current_dir(&dir);
    // From here on the Proc stops the server and removes the directory,
    // whatever fails.
    let mut p = local::spawn("mariadbd", cmd, dir)?.terminate_first(MARIADB_STOP_GRACE);
    let started = Instant::now();
    loop {
        let ready = mariadb_client(&sock, "SELECT 1").await;
        if ready.is_ok() {
            break;
        }
        if let Some(status) = p.exited() {
            return Err(format!("mariadbd exited ({status}):\n{}", p.log_tail()));
        }
        if started.elapsed() > MARIADB_START_TIMEOUT {
            return Err(format!(
                "mariadbd accepted no login within {MARIADB_START_TIMEOUT:?} ({}):\n{}",
                ready.unwrap_err(),
                p.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    mariadb_client(&sock, "CREATE DATABASE IF NOT EXISTS fencer")
        .await
        .map_err(|e| format!("mariadb: {e}"))?;
    Ok((p, format!("mysql://root@127.0.0.1:{port}/fencer")))
}

/// Runs `sql` as root with the `mariadb` client over the socket `sock`.
async fn mariadb_client(sock: &Path, sql: &str) -> Result<(), String> {
    let out = tokio::process::Command::new("mariadb")
        .arg("--no-defaults")
        .arg(format!("--socket={}", sock.display()))
        .args(["-uroot", "-e", sql])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("the mariadb client: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn pg_bin() -> Result<PathBuf, String> {
    let base = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(base)
        .map_err(|e| format!("{}: {e} (apt-get install postgresql)", base.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, b)| b)
        .ok_or_else(|| "no PostgreSQL server binaries under /usr/lib/postgresql".into())
}

fn effective_uid() -> Result<u32, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .ok_or_else(|| "no Uid in /proc/self/status".into())
}

/// (uid, gid) of a local user, from /etc/passwd.
fn user_ids(name: &str) -> Result<(u32, u32), String> {
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(|e| e.to_string())?;
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&name))
        .and_then(|f| Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?)))
        .ok_or_else(|| format!("running as root needs an OS user {name:?} for PostgreSQL"))
}

/// A ZooKeeper ensemble of `n` members (Debian's `zookeeper` package) on
/// loopback; returns the members and the connect string once one leads.
pub async fn zookeeper(n: usize) -> Result<(Vec<Proc>, String), String> {
    let jars = zookeeper_classpath()?;
    let ports: Vec<(u16, u16, u16)> = (0..n)
        .map(|_| {
            Ok((
                local::free_port()?,
                local::free_port()?,
                local::free_port()?,
            ))
        })
        .collect::<Result<_, String>>()?;
    let mut members = Vec::new();
    for (i, (client, _, _)) in ports.iter().enumerate() {
        let dir = local::temp_dir("zookeeper")?;
        let data = dir.join("data");
        std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        std::fs::write(data.join("myid"), format!("{}\n", i + 1)).map_err(|e| e.to_string())?;
        let mut cfg = format!(
            "tickTime=200\ninitLimit=20\nsyncLimit=5\ndataDir={}\nclientPort={client}\n\
             clientPortAddress=127.0.0.1\nadmin.enableServer=false\nmaxClientCnxns=0\n\
             minSessionTimeout=1000\nmaxSessionTimeout=120000\nreconfigEnabled=false\n\
             4lw.commands.whitelist=srvr\nforceSync=no\n",
            data.display()
        );
        if n > 1 {
            for (j, (_, peer, election)) in ports.iter().enumerate() {
                cfg.push_str(&format!("server.{}=127.0.0.1:{peer}:{election}\n", j + 1));
            }
        }
        let conf = dir.join("zoo.cfg");
        std::fs::write(&conf, cfg).map_err(|e| e.to_string())?;
        let mut cmd = Command::new("java");
        cmd.args([
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-Dzookeeper.admin.enableServer=false",
        ])
        .arg("-cp")
        .arg(&jars)
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(&conf);
        members.push(local::spawn("zookeeper", cmd, dir)?);
    }
    let started = Instant::now();
    loop {
        let modes: Vec<Option<String>> = ports.iter().map(|(p, _, _)| zk_mode(*p)).collect();
        let leaders = modes
            .iter()
            .filter(|m| m.as_deref() == Some("leader"))
            .count();
        let serving = modes.iter().filter(|m| m.is_some()).count();
        if serving == n && (n == 1 || leaders == 1) {
            break;
        }
        for p in members.iter_mut() {
            if p.exited().is_some() {
                return Err(format!("a ZooKeeper member exited:\n{}", p.log_tail()));
            }
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!("ZooKeeper did not form a quorum ({modes:?})"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let connect = ports
        .iter()
        .map(|(p, _, _)| format!("127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");
    Ok((members, connect))
}

/// An etcd cluster of `n` members (Debian's `etcd-server` package) on
/// loopback; returns the members and their client URLs once every member
/// follows one leader. Data under /dev/shm where there is one: etcd 3.4
/// fsyncs every commit and cannot be told not to, and ZooKeeper here runs
/// with `forceSync=no` — the bench compares lock recipes, not disks.
pub async fn etcd(n: usize) -> Result<(Vec<Proc>, Vec<String>), String> {
    if !Path::new("/usr/bin/etcd").exists() {
        return Err("etcd is not installed (apt-get install etcd-server)".into());
    }
    let ports: Vec<(u16, u16)> = (0..n)
        .map(|_| Ok((local::free_port()?, local::free_port()?)))
        .collect::<Result<_, String>>()?;
    let cluster = ports
        .iter()
        .enumerate()
        .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut members = Vec::new();
    for (i, (client, peer)) in ports.iter().enumerate() {
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            let d = shm.join(format!(
                "fencer-bench-etcd-{}-{}",
                std::process::id(),
                rand::random::<u32>()
            ));
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            d
        } else {
            local::temp_dir("etcd")?
        };
        let data = dir.join("data");
        let (client, peer) = (
            format!("http://127.0.0.1:{client}"),
            format!("http://127.0.0.1:{peer}"),
        );
        let mut cmd = Command::new("/usr/bin/etcd");
        cmd.args(["--name", &format!("m{i}")])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-level", "warn"]);
        members.push(local::spawn("etcd", cmd, dir)?);
    }
    let started = Instant::now();
    loop {
        let leaders: Vec<Option<String>> = ports.iter().map(|(p, _)| etcd_leader(*p)).collect();
        if leaders.iter().all(|l| l.is_some() && *l == leaders[0]) {
            break;
        }
        for p in members.iter_mut() {
            if p.exited().is_some() {
                return Err(format!("an etcd member exited:\n{}", p.log_tail()));
            }
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!("etcd did not elect a leader ({leaders:?})"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let endpoints = ports
        .iter()
        .map(|(p, _)| format!("http://127.0.0.1:{p}"))
        .collect();
    Ok((members, endpoints))
}

/// The leader a member follows (`maintenance/status` on its JSON
/// gateway), once it has one.
fn etcd_leader(port: u16) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    let body = "{}";
    write!(
        s,
        "POST /v3/maintenance/status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let json: serde_json::Value = serde_json::from_str(out.split_once("\r\n\r\n")?.1).ok()?;
    json["leader"].as_str().map(str::to_owned)
}

/// The member's mode from the `srvr` four-letter word, once it serves.
fn zk_mode(port: u16) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(b"srvr").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Mode: "))
        .map(str::to_owned)
}

/// The jars of Debian's `zookeeper` package and its dependencies that
/// exist, `:`-joined.
pub fn zookeeper_classpath() -> Result<String, String> {
    let jars: Vec<String> = [
        "zookeeper",
        "zookeeper-jute",
        "slf4j-api",
        "slf4j-simple",
        "netty-handler",
        "netty-common",
        "netty-buffer",
        "netty-transport",
        "netty-codec",
        "netty-resolver",
        "netty-transport-native-epoll",
        "netty-transport-native-unix-common",
        "metrics-core",
    ]
    .iter()
    .map(|j| format!("/usr/share/java/{j}.jar"))
    .filter(|p| Path::new(p).exists())
    .collect();
    if !jars.iter().any(|j| j.ends_with("/zookeeper.jar")) {
        return Err("ZooKeeper is not installed (apt-get install zookeeper)".into());
    }
    Ok(jars.join(":"))
}
