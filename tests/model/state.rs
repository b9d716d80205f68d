//! The model's global state: every actor's state and the network, kept in
//! a canonical form (sorted collections) so equal situations hash equal.

use super::backend::Backend;
use super::clock::Clocks;
use super::gateway::Gateway;
use super::network::Network;
use super::sidecar::Sidecar;

pub type ClientId = u8;
pub type SidecarId = u8;
pub type LeaseId = u8;
pub type AttemptNo = u8;
pub type Token = u8;
pub use super::clock::Time;

/// What a client was last told, and what it does now.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClientPhase {
    Idle,
    /// Waiting for its sidecar's answer to an acquire.
    Acquiring,
    /// Told "held": may renew, write, release.
    Holding {
        lease: LeaseId,
        token: Token,
        wrote: bool,
    },
    /// Waiting for the answer to a renewal of `lease`.
    Renewing {
        lease: LeaseId,
        token: Token,
        wrote: bool,
    },
    /// Waiting for the answer to a release.
    Releasing,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    pub phase: ClientPhase,
    /// The lease the client was last told holds the key, and until when
    /// (on its sidecar's clock): the deadline that "held" answer reported
    /// (`remaining_ms`). An acquire or renewal answer names the client's
    /// own lease; a `GET` answer names whichever lease the sidecar shows
    /// (by its tag), which may be another local client's.
    pub belief: Option<(LeaseId, Time)>,
    pub acquires: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub clocks: Clocks,
    pub clients: Vec<Client>,
    pub sidecars: Vec<Sidecar>,
    pub backend: Backend,
    pub gateway: Gateway,
    pub network: Network,
    pub next_lease: LeaseId,
    /// The last token a client was told with "held" by an acquire, and its
    /// lease (tokens must increase from lease to lease).
    pub last_told: Option<(Token, LeaseId)>,
    /// Set when a token was handed out not above one handed out before to
    /// another lease.
    pub token_went_back: bool,
    /// The highest token of a write the storage applied, and whether one
    /// was ever applied below it.
    pub storage_max: Option<Token>,
    pub stale_write_applied: bool,
}

impl State {
    pub fn sidecar_of(&self, c: ClientId) -> SidecarId {
        (c as usize % self.sidecars.len()) as SidecarId
    }

    /// Whether client `c` believes, right now, that it holds the key.
    pub fn believes(&self, c: ClientId) -> bool {
        let s = self.sidecar_of(c);
        self.clients[c as usize]
            .belief
            .is_some_and(|(_, d)| self.clocks.sidecar(s) < d)
    }

    /// One tick of true time: every timestamp ages by what its clock
    /// advanced (`clock.rs`).
    pub fn tick(&mut self, cfg: &super::config::Config, t: super::clock::Tick) {
        let (side, back) = self.clocks.tick(t);
        let floor = -(cfg.ttl as i8) - 1;
        for c in &mut self.clients {
            if let Some((_, u)) = c.belief.as_mut() {
                super::clock::age(u, side, floor);
            }
        }
        for s in &mut self.sidecars {
            s.age(side, floor);
        }
        self.network.age(side, floor);
        self.backend.age(back);
    }

    /// Forgets beliefs whose time is up and puts collections in canonical
    /// order.
    pub fn normalize(&mut self) {
        for c in 0..self.clients.len() {
            if !self.believes(c as ClientId) {
                self.clients[c].belief = None;
                // Its time is up: a holder whose lease ran out is idle.
                if matches!(self.clients[c].phase, ClientPhase::Holding { .. }) {
                    self.clients[c].phase = ClientPhase::Idle;
                }
            }
        }
        self.network.normalize();
        for s in &mut self.sidecars {
            s.normalize();
        }
        self.backend.normalize();
    }
}
