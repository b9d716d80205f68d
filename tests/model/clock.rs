//! Clocks and time. Every timestamp in the state is kept *relative to the
//! current reading of its own clock* (a sidecar's for its deadlines and
//! send times, the backend's for a row's expiry), so "now" is always 0 and
//! a tick subtracts what each clock advanced. Two situations that differ
//! only in when they happened are then one state: every comparison the
//! protocol makes is between a timestamp and its own clock.
//!
//! Drift: the sidecars' clocks run with true time, the backend's may run
//! slow or fast, at most `drift` ticks off true time and one tick per tick.
//! What the protocol depends on is each sidecar's clock against the
//! backend's (a sidecar's deadline against the row's expiry), so this
//! covers each pair drifting by up to `2 * drift` over any interval.

use super::config::Config;
use super::state::SidecarId;

/// Readings and timestamps, relative (see the module comment).
pub type Time = i8;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Clocks {
    /// How far the backend's clock is ahead of true time (−drift..=drift).
    pub backend_offset: i8,
}

/// How one tick of true time moves the backend's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tick {
    /// Every clock advances one tick.
    Even,
    /// The backend's clock stands still (runs slow).
    BackendSlow,
    /// The backend's clock advances two ticks (runs fast).
    BackendFast,
}

impl Clocks {
    pub fn new() -> Clocks {
        Clocks { backend_offset: 0 }
    }

    /// A sidecar's reading: timestamps are relative to it.
    pub fn sidecar(&self, _s: SidecarId) -> Time {
        0
    }

    /// The backend's reading: timestamps are relative to it.
    pub fn backend(&self) -> Time {
        0
    }

    /// Ticks allowed now.
    pub fn ticks(&self, cfg: &Config, out: &mut Vec<Tick>) {
        out.push(Tick::Even);
        let d = cfg.drift as i8;
        if self.backend_offset > -d {
            out.push(Tick::BackendSlow);
        }
        if self.backend_offset < d {
            out.push(Tick::BackendFast);
        }
    }

    /// Applies a tick; returns how far the sidecars' and the backend's
    /// clocks advanced.
    pub fn tick(&mut self, t: Tick) -> (i8, i8) {
        match t {
            Tick::Even => (1, 1),
            Tick::BackendSlow => {
                self.backend_offset -= 1;
                (1, 0)
            }
            Tick::BackendFast => {
                self.backend_offset += 1;
                (1, 2)
            }
        }
    }
}

/// A timestamp `by` ticks older, kept no lower than `floor` (anything at
/// or below it compares the same against every reading to come).
pub fn age(t: &mut Time, by: i8, floor: i8) {
    *t = (*t - by).max(floor);
}
