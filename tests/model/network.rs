//! The network between the sidecars, the backend, the gateway and the
//! storage: a bounded multiset of messages in flight. Any message may be
//! delivered next (delay and reordering), or dropped; what a message's
//! sender does when no reply comes is the sender's timeout, not the
//! network's business. The client↔sidecar hop is localhost: calls and
//! answers there are steps of the sidecar, and a client "disconnects" by
//! abandoning its call.

use super::state::{AttemptNo, ClientId, LeaseId, SidecarId, Time, Token};

/// The backend's answer to an acquire try (`Attempt` / status -2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AcqReply {
    Acquired(Token),
    Held,
    /// Voided by its undo before it ran: nothing taken.
    Voided,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    // sidecar -> backend
    Acquire {
        s: SidecarId,
        lease: LeaseId,
        attempt: AttemptNo,
    },
    /// The undo of an abandoned try (`sql::VOID_ATTEMPT`).
    VoidAttempt {
        s: SidecarId,
        lease: LeaseId,
        attempt: AttemptNo,
    },
    Release {
        s: SidecarId,
        lease: LeaseId,
    },
    Renew {
        s: SidecarId,
        lease: LeaseId,
        sent: Time,
    },
    // backend -> sidecar
    AcquireReply {
        s: SidecarId,
        lease: LeaseId,
        attempt: AttemptNo,
        reply: AcqReply,
    },
    ReleaseReply {
        s: SidecarId,
        lease: LeaseId,
        owned: bool,
    },
    RenewReply {
        s: SidecarId,
        lease: LeaseId,
        sent: Time,
        owned: bool,
    },
    // sidecar -> gateway and back
    Prereg {
        s: SidecarId,
        lease: LeaseId,
        token: Token,
    },
    PreregReply {
        s: SidecarId,
        lease: LeaseId,
        ok: bool,
    },
    // proxy -> gateway -> storage
    Write {
        c: ClientId,
        lease: LeaseId,
        token: Token,
    },
    Forward {
        token: Token,
    },
}

impl Msg {
    /// Messages the network may lose. The gateway's forward is not one:
    /// the gateway holds the key until the storage applied it or never
    /// will (`KeyHold::release`), which is the storage's precondition.
    pub fn droppable(&self) -> bool {
        !matches!(self, Msg::Forward { .. })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Network {
    pub in_flight: Vec<Msg>,
}

impl Network {
    pub fn send(&mut self, m: Msg) {
        self.in_flight.push(m);
    }

    /// Takes `m` off the network (delivered or dropped).
    pub fn take(&mut self, m: &Msg) -> bool {
        match self.in_flight.iter().position(|x| x == m) {
            Some(i) => {
                self.in_flight.remove(i);
                true
            }
            None => false,
        }
    }

    /// Send times carried by renewals age with their sidecar's clock.
    pub fn age(&mut self, by: i8, floor: i8) {
        for m in &mut self.in_flight {
            if let Msg::Renew { sent, .. } | Msg::RenewReply { sent, .. } = m {
                super::clock::age(sent, by, floor);
            }
        }
    }

    pub fn normalize(&mut self) {
        self.in_flight.sort();
    }
}
