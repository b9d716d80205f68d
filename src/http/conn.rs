//! What bounds one connection's silence: the time to its first byte, and
//! its time without a request in flight.
//!
//! hyper bounds neither where it matters: its auto (HTTP/1 or h2c)
//! connection first reads the protocol preface with no timeout at all, the
//! HTTP/1 header timeout only starts once that is done, and h2 has no idle
//! timeout. A client that connects and says nothing (or says the h2
//! preface and then nothing) kept its descriptor forever — 150 of them
//! wedged a gateway running with 128 descriptors (issue 27). So every
//! connection carries an [`Activity`]: its IO ([`Watched`]) reports the
//! first byte, its requests ([`InFlight`], held until the response body
//! ends) report whether anything is in flight, and [`watch`] says when the
//! connection has been silent too long. Silence with a request in flight
//! is not idleness: a blocking acquire that waits minutes, or a `/hold`
//! stream, is never cut.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long a connection may stay silent (`[http]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Silence {
    /// From accept to the connection's first byte (for TLS, its first
    /// decrypted byte: the handshake is inside this bound).
    pub first_byte: Duration,
    /// With no request in flight, from the connection's first byte or its
    /// last response's end to its close (h2: GOAWAY first).
    pub idle: Duration,
}

impl Default for Silence {
    fn default() -> Self {
        Silence {
            first_byte: Duration::from_secs(10),
            idle: Duration::from_secs(60),
        }
    }
}

/// Why a connection was closed by the server before its client was done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// No byte within [`Silence::first_byte`].
    FirstByteTimeout,
    /// Nothing in flight for [`Silence::idle`].
    IdleTimeout,
    /// Closed before its first byte to make room for a new connection at
    /// the descriptor or connection limit.
    Shed,
}

impl Close {
    /// The `reason` label of `fencer_http_connections_closed_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Close::FirstByteTimeout => "first_byte_timeout",
            Close::IdleTimeout => "idle_timeout",
            Close::Shed => "shed",
        }
    }
}

/// One connection's traffic as its watchdog needs it: a few atomics, and a
/// wake-up only when the first byte arrives or the last request ends (not
/// per read, not per request start).
#[derive(Debug)]
pub struct Activity {
    start: Instant,
    first_byte: AtomicBool,
    in_flight: AtomicUsize,
    /// Milliseconds from `start` to the end of the last request (or to the
    /// first byte, before any request ended).
    last_end_ms: AtomicU64,
    wake: Notify,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            start: Instant::now(),
            first_byte: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            last_end_ms: AtomicU64::new(0),
            wake: Notify::new(),
        })
    }

    fn since_start_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn saw_first_byte(&self) {
        self.last_end_ms
            .store(self.since_start_ms(), Ordering::Relaxed);
        self.first_byte.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// A request has started; it is in flight until the guard drops (with
    /// the response body, or with the request's future if the client
    /// left before the answer).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// Restarts the idle clock: the grace after a GOAWAY counts from now.
    fn touch(&self) {
        self.last_end_ms
            .store(self.since_start_ms(), Ordering::Relaxed);
    }

    /// Resolves when the first byte has arrived.
    pub async fn first_byte(&self) {
        while !self.first_byte.load(Ordering::Acquire) {
            // `notify_one` keeps a permit when nobody waits: a byte that
            // arrives between the load and this await still wakes us.
            self.wake.notified().await;
        }
    }

    /// Resolves once nothing has been in flight for `idle` (counted from
    /// the last request's end, or the first byte).
    pub async fn idle_for(&self, idle: Duration) {
        loop {
            if self.in_flight.load(Ordering::Acquire) > 0 {
                // The last request's end notifies; a stale permit only
                // costs one more turn of this loop.
                self.wake.notified().await;
                continue;
            }
            let last = self.last_end_ms.load(Ordering::Relaxed);
            let deadline = self.start + Duration::from_millis(last) + idle;
            tokio::time::sleep_until(deadline).await;
            // A request may have come and gone while we slept: only a
            // connection whose clock did not move is idle.
            if self.in_flight.load(Ordering::Acquire) == 0
                && self.last_end_ms.load(Ordering::Relaxed) == last
            {
                return;
            }
        }
    }
}

/// A request in flight on its connection (see [`Activity::begin`]).
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_end_ms.store(a.since_start_ms(), Ordering::Relaxed);
        if a.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            a.wake.notify_one();
        }
    }
}

/// A response body that keeps its request [`InFlight`] until it ends or
/// is dropped: a `/hold` stream is in flight for as long as it streams.
pub struct Tracked<B> {
    body: B,
    _in_flight: InFlight,
}

impl<B> Tracked<B> {
    pub fn new(body: B, in_flight: InFlight) -> Tracked<B> {
        Tracked {
            body,
            _in_flight: in_flight,
        }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A connection's IO that reports its first byte to its [`Activity`];
/// after that, a plain pass-through (one `Option` check per read).
pub struct Watched<Io> {
    io: Io,
    activity: Option<Arc<Activity>>,
}

impl<Io> Watched<Io> {
    pub fn new(io: Io, activity: Arc<Activity>) -> Watched<Io> {
        Watched {
            io,
            activity: Some(activity),
        }
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for Watched<Io> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.io).poll_read(cx, buf);
        if this.activity.is_some() && buf.filled().len() > before {
            if let Some(a) = this.activity.take() {
                a.saw_first_byte();
            }
        }
        poll
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Watched<Io> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// After an idle close began (h2: GOAWAY sent), how long the connection
/// may take to finish: a request that slipped in before the GOAWAY is
/// served, and then the connection gets this long without one in flight.
/// A client that never answers the GOAWAY's PING is dropped after it.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Restarts the idle clock and resolves once the connection has had
/// nothing in flight for [`CLOSE_GRACE`].
pub async fn grace(activity: &Activity) {
    activity.touch();
    activity.idle_for(CLOSE_GRACE).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_counts_from_the_last_request_end_and_never_while_one_is_in_flight() {
        let a = Activity::new();
        a.saw_first_byte();
        let idle = Duration::from_secs(5);
        let guard = a.begin();
        // In flight: not idle however long it takes.
        assert!(
            tokio::time::timeout(Duration::from_secs(60), a.idle_for(idle))
                .await
                .is_err()
        );
        drop(guard);
        let ended = Instant::now();
        a.idle_for(idle).await;
        assert_eq!(ended.elapsed(), idle);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_during_the_idle_sleep_moves_the_clock() {
        let a = Activity::new();
        a.saw_first_byte();
        let idle = Duration::from_secs(5);
        let a2 = a.clone();
        let start = Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let g = a2.begin();
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(g);
        });
        a.idle_for(idle).await;
        assert_eq!(start.elapsed(), Duration::from_secs(4) + idle);
    }
}
