//! The gateway and the storage behind it: the key's mark (highest token
//! accepted, and its lease), the in-flight stamp that keeps the key while a
//! forwarded write may still land, and the storage's applied writes.

use super::network::Msg;
use super::state::{LeaseId, Token};

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Gateway {
    /// `(token, lease)` of the highest token accepted.
    pub mark: Option<(Token, LeaseId)>,
    /// The token of the write forwarded and not yet applied: while set, the
    /// key admits nothing else (the turn and the stamp).
    pub in_flight: Option<Token>,
}

impl Gateway {
    /// Admission (`FenceStore::admit`): above the mark advances it, the
    /// mark's own lease passes, anything else is stale.
    fn admit(&mut self, token: Token, lease: LeaseId) -> bool {
        match self.mark {
            Some((t, _)) if token < t => false,
            Some((t, l)) if token == t => l == lease,
            _ => {
                self.mark = Some((token, lease));
                true
            }
        }
    }

    /// Whether `m` can be taken now (a request waits for the key's turn).
    pub fn ready(&self, m: &Msg) -> bool {
        match m {
            Msg::Prereg { .. } | Msg::Write { .. } => self.in_flight.is_none(),
            _ => true,
        }
    }

    /// Handles a message that reached the gateway; returns what it sends.
    pub fn apply(&mut self, m: &Msg) -> Option<Msg> {
        match *m {
            // preregister::handle
            Msg::Prereg { s, lease, token } => {
                let ok = self.admit(token, lease);
                Some(Msg::PreregReply { s, lease, ok })
            }
            // fenced::Fenced::run: admit, stamp, forward.
            Msg::Write { lease, token, .. } => {
                if self.admit(token, lease) {
                    self.in_flight = Some(token);
                    Some(Msg::Forward { token })
                } else {
                    None
                }
            }
            _ => unreachable!("not a gateway message: {m:?}"),
        }
    }

    /// The storage applied the forwarded write: the key's hold ends
    /// (`KeyHold::release`).
    pub fn applied(&mut self) {
        self.in_flight = None;
    }
}
