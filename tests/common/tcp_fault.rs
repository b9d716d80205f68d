//! A loopback TCP proxy whose faults a test switches at run time.
//!
//! Put between a fencer process and a service (Redis, PostgreSQL, the
//! gateway, the storage), it forwards bytes both ways until told to:
//! - [`Mode::DelayReplies`]: hold every server→client chunk for a while
//!   (a reply that comes late);
//! - [`Mode::FreezeUnscripted`]: stop forwarding, both ways, on connections
//!   that never sent a Redis script command — in practice the pub/sub
//!   connection — while the command connection goes on (a half-open
//!   subscriber);
//! - [`Mode::FreezeAll`]: stop forwarding on every connection (a network
//!   partition that keeps the sockets open);
//! - [`Mode::DelayReplyTo`]: hold back only the *reply* to the next request
//!   that contains a marker (e.g. the lock key), once; the request itself
//!   reaches the server at once, so the statement is applied while its
//!   caller times out (PITFALLS 11: the reply, not the request, late);
//! - [`TcpFault::delay_request_to`]: hold back the next client→server
//!   chunk containing a marker (e.g. the lock key, or a statement's name),
//!   once, independently of the mode; later chunks of that connection wait
//!   behind it, as TCP would. The statement reaches the server late, after
//!   its caller (and whatever cleans up after it) gave up;
//! - [`TcpFault::reset_all`]: close every connection at once.
//!
//! Thread-based, so it works from sync and async tests alike.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Pass,
    DelayReplies(Duration),
    FreezeUnscripted,
    FreezeAll,
    /// The first server→client chunk after the next client→server chunk
    /// containing `marker` is held for `delay`; then back to `Pass`.
    DelayReplyTo {
        marker: &'static [u8],
        delay: Duration,
    },
}

struct Conn {
    /// The client sent EVALSHA / EVAL / SCRIPT on this connection.
    scripted: AtomicBool,
    /// Hold the next reply on this connection this long.
    delay_next_reply: Mutex<Option<Duration>>,
    client: TcpStream,
    server: TcpStream,
}

/// A one-shot hold of a request chunk (see [`TcpFault::delay_request_to`]).
struct RequestHold {
    marker: &'static [u8],
    delay: Duration,
}

struct Shared {
    mode: Mutex<Mode>,
    stop: AtomicBool,
    conns: Mutex<Vec<Arc<Conn>>>,
    request_holds: Mutex<Vec<RequestHold>>,
    /// Held request chunks matched so far / forwarded after their hold.
    requests_held: AtomicUsize,
    requests_released: AtomicUsize,
}

impl Shared {
    fn mode(&self) -> Mode {
        *self.mode.lock().unwrap()
    }

    fn frozen(&self, conn: &Conn) -> bool {
        match self.mode() {
            Mode::FreezeAll => true,
            Mode::FreezeUnscripted => !conn.scripted.load(Ordering::SeqCst),
            _ => false,
        }
    }
}

pub struct TcpFault {
    pub port: u16,
    shared: Arc<Shared>,
}

impl TcpFault {
    /// Listens on a free loopback port and forwards to `upstream_port`.
    pub fn start(upstream_port: u16) -> TcpFault {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Pass),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            request_holds: Mutex::new(Vec::new()),
            requests_held: AtomicUsize::new(0),
            requests_released: AtomicUsize::new(0),
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if sh.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream_port)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let conn = Arc::new(Conn {
                    scripted: AtomicBool::new(false),
                    delay_next_reply: Mutex::new(None),
                    client: client.try_clone().unwrap(),
                    server: server.try_clone().unwrap(),
                });
                sh.conns.lock().unwrap().push(conn.clone());
                for upstream_bound in [true, false] {
                    let (from, to) = if upstream_bound {
                        (client.try_clone().unwrap(), server.try_clone().unwrap())
                    } else {
                        (server.try_clone().unwrap(), client.try_clone().unwrap())
                    };
                    let (sh, conn) = (sh.clone(), conn.clone());
                    std::thread::spawn(move || pump(sh, conn, from, to, upstream_bound));
                }
            }
        });
        TcpFault { port, shared }
    }

    pub fn set(&self, mode: Mode) {
        *self.shared.mode.lock().unwrap() = mode;
    }

    /// Holds the next client→server chunk that contains `marker` for
    /// `delay` before forwarding it (once per call; several holds may be
    /// pending, each matches one chunk, in the order they were added).
    pub fn delay_request_to(&self, marker: &'static [u8], delay: Duration) {
        self.shared
            .request_holds
            .lock()
            .unwrap()
            .push(RequestHold { marker, delay });
    }

    /// How many request chunks a hold has caught so far.
    pub fn requests_held(&self) -> usize {
        self.shared.requests_held.load(Ordering::SeqCst)
    }

    /// How many held request chunks have been forwarded since.
    pub fn requests_released(&self) -> usize {
        self.shared.requests_released.load(Ordering::SeqCst)
    }

    /// Closes every open connection (both sides).
    pub fn reset_all(&self) {
        for c in self.shared.conns.lock().unwrap().drain(..) {
            let _ = c.client.shutdown(Shutdown::Both);
            let _ = c.server.shutdown(Shutdown::Both);
        }
    }

    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for TcpFault {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.set(Mode::Pass);
        self.reset_all();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pump(sh: Arc<Shared>, conn: Arc<Conn>, mut from: TcpStream, mut to: TcpStream, up: bool) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        if up {
            let upper = chunk.to_ascii_uppercase();
            if upper.windows(4).any(|w| w == b"EVAL") || upper.windows(6).any(|w| w == b"SCRIPT") {
                conn.scripted.store(true, Ordering::SeqCst);
            }
            let mut mode = sh.mode.lock().unwrap();
            if let Mode::DelayReplyTo { marker, delay } = *mode {
                if chunk.windows(marker.len()).any(|w| w == marker) {
                    *conn.delay_next_reply.lock().unwrap() = Some(delay);
                    *mode = Mode::Pass;
                }
            }
        }
        let hold = if up {
            let mut holds = sh.request_holds.lock().unwrap();
            let i = holds
                .iter()
                .position(|h| chunk.windows(h.marker.len()).any(|w| w == h.marker));
            i.map(|i| holds.remove(i).delay)
        } else {
            None
        };
        if let Some(d) = hold {
            sh.requests_held.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(d);
        }
        while sh.frozen(&conn) && !sh.stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if !up {
            if let Mode::DelayReplies(d) = sh.mode() {
                std::thread::sleep(d);
            }
            let held = conn.delay_next_reply.lock().unwrap().take();
            if let Some(d) = held {
                std::thread::sleep(d);
            }
        }
        if to.write_all(chunk).is_err() {
            break;
        }
        if hold.is_some() {
            sh.requests_released.fetch_add(1, Ordering::SeqCst);
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
