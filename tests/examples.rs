//! The client examples in `examples/<language>/` run against `fencer dev`.
//!
//! Each test starts its own `fencer dev` on free ports, runs every example of
//! one language with `FENCER_API` / `FENCER_PROXY` pointing at it (60 s each,
//! killed past that), and checks the exit code and every line printed: the
//! five scenarios print the same lines in every language. It then checks the
//! storage behind the gateway: the proxied write landed, and the write the
//! proxy refused after the lease was lost did not.
//!
//! The Python and Node examples use the client libraries in `clients/`:
//! Python finds `clients/python/src` on `PYTHONPATH`; Node runs a copy of
//! the examples with `clients/node` installed by `npm install` (offline).
//!
//! A missing interpreter fails the test, naming what to install.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::http_ok;

const EXAMPLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The lines each scenario prints, in order; `#` stands for a number.
const ACQUIRE: &[&str] = &[
    "acquired token=#",
    "second acquire refused: lock_held",
    "released",
];
const HOLD: &[&str] = &[
    "acquired token=#",
    "heartbeat remaining_ms=#",
    "heartbeat remaining_ms=#",
    "stream closed",
    "lock free again token=#",
];
const AUTO_RENEW: &[&str] = &[
    "acquired token=# ttl_ms=#",
    "step 1: keepalive ok",
    "step 2: keepalive ok",
    "step 3: keepalive ok",
    "step 4: keepalive ok",
    "step 5: keepalive ok",
    "step 6: keepalive ok",
    "after 3000 ms with a 1000 ms ttl: held",
    "released",
];
const PROXY_WRITE: &[&str] = &[
    "acquired token=#",
    "write ok",
    "read back balance=100",
    "released",
];
const LEASE_LOST: &[&str] = &[
    "acquired token=# ttl_ms=#",
    "write ok balance=1",
    "pausing 1500 ms (longer than the ttl, no renew)",
    "lease lost: stopping",
];

/// `fencer dev` on free ports, stopped (SIGTERM, then SIGKILL) on drop.
struct Dev {
    child: Child,
    api: String,
    proxy: String,
    storage: String,
    log: tempfile::NamedTempFile,
}

impl Dev {
    fn start() -> Dev {
        let (mut cmd, [api, proxy, _, storage, admin]) = common::dev::Dev::command();
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = cmd
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        let dev = Dev {
            child,
            api: format!("http://127.0.0.1:{api}"),
            proxy: format!("http://127.0.0.1:{proxy}"),
            storage: format!("http://127.0.0.1:{storage}"),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(http_ok(&format!("http://127.0.0.1:{admin}/readyz"))
            && http_ok(&format!("http://127.0.0.1:{storage}/healthz")))
        {
            assert!(
                Instant::now() < deadline,
                "fencer dev did not become ready:\n{}",
                dev.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        dev
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET url` over plain TCP: (status, body).
fn http_get(url: &str) -> (u16, String) {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let mut stream = TcpStream::connect(host).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_owned())
}

/// Fails the test, naming what to install, unless `cmd` runs and exits 0.
fn require(what: &str, install: &str, cmd: &str, args: &[&str]) {
    common::require_tool("the examples", what, install, cmd, args)
}

/// The numbers matched by `#` if `line` matches `pattern`.
fn matches(pattern: &str, line: &str) -> Option<Vec<u64>> {
    let mut numbers = Vec::new();
    let mut rest = line;
    for (i, part) in pattern.split('#').enumerate() {
        if i > 0 {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 {
                return None;
            }
            numbers.push(rest[..digits].parse().ok()?);
            rest = &rest[digits..];
        }
        rest = rest.strip_prefix(part)?;
    }
    rest.is_empty().then_some(numbers)
}

/// Runs one example (in its language's directory) against `dev`; asserts
/// exit code 0 and exactly the `expected` lines. Returns the numbers the
/// `#`s matched, in order.
fn run(dev: &Dev, place: &Place, cmd: &[&str], expected: &[&str]) -> Vec<u64> {
    let dir = &place.dir;
    let started = Instant::now();
    let mut child = Command::new(cmd[0])
        .args(&cmd[1..])
        .current_dir(dir)
        .envs(place.env.iter().map(|(k, v)| (k, v)))
        .env("FENCER_API", &dev.api)
        .env("FENCER_PROXY", &dev.proxy)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .env_remove("all_proxy")
        .env_remove("ALL_PROXY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let pgid = child.id() as i32;
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > EXAMPLE_TIMEOUT {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // The whole process group: a shell example's curl, too.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
    let _ = child.wait();
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    let elapsed = started.elapsed();
    println!("{:>6.2} s  {}", elapsed.as_secs_f64(), cmd.join(" "));
    let context = || {
        format!(
            "{cmd:?} in {}\n--- stdout\n{stdout}--- stderr\n{stderr}--- fencer dev (last 4000 bytes)\n{}",
            dir.display(),
            tail(&dev.logs(), 4000)
        )
    };
    let Some(status) = status else {
        panic!("timed out after {EXAMPLE_TIMEOUT:?}, killed: {}", context());
    };
    assert!(status.success(), "exit {status}: {}", context());
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        expected.len(),
        "expected the lines {expected:#?}: {}",
        context()
    );
    let mut numbers = Vec::new();
    for (line, pattern) in lines.iter().zip(expected) {
        match matches(pattern, line) {
            Some(n) => numbers.extend(n),
            None => panic!("`{line}` does not match `{pattern}`: {}", context()),
        }
    }
    numbers
}

fn tail(text: &str, bytes: usize) -> &str {
    let mut start = text.len().saturating_sub(bytes);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// Where one language's examples run (their folder, or a copy of it) and
/// what they need in their environment (e.g. where the client library is).
struct Place {
    dir: PathBuf,
    env: Vec<(&'static str, String)>,
    _copy: Option<tempfile::TempDir>,
}

impl Place {
    /// The examples' own folder.
    fn examples(lang: &str) -> Place {
        Place {
            dir: repo().join("examples").join(lang),
            env: Vec::new(),
            _copy: None,
        }
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the five scenarios of one language; `cmd(file)` is its command line.
fn run_language(lang: &str, files: [&str; 5], cmd: impl Fn(&str) -> Vec<String>) {
    run_language_in(Place::examples(lang), lang, files, cmd)
}

/// Runs the five scenarios of one language in `place`.
fn run_language_in(place: Place, lang: &str, files: [&str; 5], cmd: impl Fn(&str) -> Vec<String>) {
    let dir = place.dir.clone();
    let dev = Dev::start();
    let started = Instant::now();
    let mut results = Vec::new();
    for (file, expected) in files
        .iter()
        .zip([ACQUIRE, HOLD, AUTO_RENEW, PROXY_WRITE, LEASE_LOST])
    {
        assert!(
            dir.join(file).is_file(),
            "missing {}",
            dir.join(file).display()
        );
        let argv = cmd(file);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        results.push(run(&dev, &place, &argv, expected));
    }
    println!(
        "{:>6.2} s  {lang}: all five examples",
        started.elapsed().as_secs_f64()
    );

    // hold: the lock was free again at once, under a newer token.
    assert!(
        results[1][3] > results[1][0],
        "hold tokens: {:?}",
        results[1]
    );
    // The proxied write landed; the write refused after the lease was lost did not.
    let (status, body) = http_get(&format!("{}/kv/example/write", dev.storage));
    assert_eq!(status, 200, "{body}");
    let stored: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(stored["value"], serde_json::json!({"balance": 100}));
    let (status, body) = http_get(&format!("{}/kv/example/lost", dev.storage));
    assert_eq!(status, 200, "{body}");
    let stored: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(stored["value"], serde_json::json!({"balance": 1}), "{body}");
    // Every example let go of what it held (the expired lease is `lost`).
    let (status, body) = http_get(&format!("{}/v1/locks", dev.api));
    assert_eq!(status, 200, "{body}");
    let leases: serde_json::Value = serde_json::from_str(&body).unwrap();
    let held: Vec<_> = leases["leases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["state"] != "lost")
        .collect();
    assert!(held.is_empty(), "leases left held: {held:?}");
}

#[test]
fn python_examples() {
    require(
        "python3 with the requests package",
        "python3 and `pip install requests` (or apt-get install python3-requests)",
        "python3",
        &["-c", "import requests"],
    );
    let files = [
        "acquire.py",
        "hold.py",
        "auto_renew.py",
        "proxy_write.py",
        "lease_lost.py",
    ];
    // The examples use the client library from its folder (clients/python),
    // as `pip install clients/python` would provide it.
    let mut place = Place::examples("python");
    place.env.push((
        "PYTHONPATH",
        repo().join("clients/python/src").display().to_string(),
    ));
    run_language_in(place, "python", files, |f| vec!["python3".into(), f.into()]);
}

#[test]
fn node_examples() {
    require(
        "Node.js 20.3 or later (fetch, AbortSignal.any: the client library)",
        "nodejs (20)",
        "node",
        &[
            "-e",
            "process.exit(typeof AbortSignal.any === 'function' ? 0 : 1)",
        ],
    );
    let files = [
        "acquire.mjs",
        "hold.mjs",
        "auto-renew.mjs",
        "proxy-write.mjs",
        "lease-lost.mjs",
    ];
    run_language_in(node_place(), "node", files, |f| {
        vec!["node".into(), f.into()]
    });
}

/// A copy of examples/node with the client library (clients/node)
/// installed by `npm install` from its folder, offline, as a user would:
/// ES modules find packages in `node_modules` only, and the copy keeps the
/// source tree free of it.
fn node_place() -> Place {
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(repo().join("examples/node")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "mjs") {
            std::fs::copy(&path, copy.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    common::clients::install_node_client(copy.path());
    Place {
        dir: copy.path().to_owned(),
        env: Vec::new(),
        _copy: Some(copy),
    }
}

#[test]
fn java_examples() {
    // The source launcher (`java File.java`) needs a JDK's compiler, not just a JRE.
    require(
        "a JDK 17 or later (`java File.java` compiles with jdk.compiler)",
        "default-jdk-headless",
        "java",
        &["--describe-module", "jdk.compiler"],
    );
    let settings = Command::new("java")
        .args(["-XshowSettings:properties", "-version"])
        .output()
        .unwrap();
    let version: u32 = String::from_utf8_lossy(&settings.stderr)
        .lines()
        .find_map(|l| l.trim().strip_prefix("java.specification.version = "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        version >= 17,
        "the examples need a JDK 17 or later, found {version}: install default-jdk-headless"
    );
    let files = [
        "Acquire.java",
        "Hold.java",
        "AutoRenew.java",
        "ProxyWrite.java",
        "LeaseLost.java",
    ];
    run_language("java", files, |f| {
        [
            "java",
            "-XX:+UseSerialGC",
            "-Xshare:auto",
            "-XX:TieredStopAtLevel=1",
            f,
        ]
        .map(String::from)
        .to_vec()
    });
}

#[test]
fn shell_examples() {
    require("bash", "bash", "bash", &["--version"]);
    require("curl", "curl", "curl", &["--version"]);
    require("jq", "jq", "jq", &["--version"]);
    let files = [
        "acquire.sh",
        "hold.sh",
        "auto-renew.sh",
        "proxy-write.sh",
        "lease-lost.sh",
    ];
    run_language("shell", files, |f| vec!["bash".into(), f.into()]);
}
