//! The MySQL backend's series: its bells (cross-sidecar wake-ups), the
//! waits on other sidecars' bells, and the idle-row clean-up.

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use super::register;

pub struct MySqlMetrics {
    /// Bell changes: rung (a lease ended here, remote waiters woken),
    /// missed (a lease held without its bell: remote waiters fall back to
    /// the expiry timer), reconnected (a bell connection came back).
    pub bell_events: IntCounterVec,
    /// How waits on another sidecar's bell ended: woken, abandoned (the
    /// waiter stopped wanting it), no_connection (every wake connection
    /// busy: counted per try, the key's queue re-checks meanwhile), failed.
    pub watch_results: IntCounterVec,
    /// Idle key rows deleted by the clean-up (their tokens live on in the
    /// floor).
    pub cleanup_rows: IntCounter,
}

impl MySqlMetrics {
    pub fn new(registry: &Registry) -> MySqlMetrics {
        let m = MySqlMetrics {
            bell_events: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_mysql_bell_events_total",
                        "MySQL backend bells (named locks that wake other sidecars): rung (a lease ended here), missed (a lease held without its bell; remote waiters use the expiry timer), given_back (a concurrent second take of a bell already held, released at once: named locks count per connection), reconnected.",
                    ),
                    &["event"],
                )
                .expect("valid metric"),
            ),
            watch_results: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "fencer_mysql_bell_waits_total",
                        "Waits on another sidecar's bell, by how they ended: woken, abandoned, no_connection (wake connections exhausted; per try), failed.",
                    ),
                    &["result"],
                )
                .expect("valid metric"),
            ),
            cleanup_rows: register(
                registry,
                IntCounter::new(
                    "fencer_mysql_cleanup_rows_total",
                    "Idle lock rows the MySQL backend deleted (tokens kept by the floor).",
                )
                .expect("valid metric"),
            ),
        };
        for e in ["rung", "missed", "given_back", "reconnected"] {
            m.bell_events.with_label_values(&[e]);
        }
        for r in ["woken", "abandoned", "no_connection", "failed"] {
            m.watch_results.with_label_values(&[r]);
        }
        m
    }
}
