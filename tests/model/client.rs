//! Clients: each talks to one sidecar over localhost, may call acquire,
//! get, renew, release and write through the proxy, and may disconnect in
//! the middle of any call. What a client believes it holds is what its
//! last answer told it: "held" until the deadline the answer reported.

use super::config::Config;
use super::sidecar::Answer;
use super::state::{ClientId, ClientPhase, State};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClientAction {
    /// `POST /v1/locks/{key}/acquire` (wait 0).
    Acquire,
    /// `GET /v1/locks/{key}` answered "held": believes until its deadline.
    Get,
    /// `POST …/renew` with its lease.
    Renew,
    /// `POST …/release`: from now on it does not count on the lock.
    Release,
    /// A write through the egress proxy, bound to its lease.
    Write,
    /// Gives up its call in flight (timeout, crash, closed socket).
    Disconnect,
}

/// The calls client `c` may make now.
pub fn actions(cfg: &Config, st: &State, c: ClientId, out: &mut Vec<ClientAction>) {
    let cl = &st.clients[c as usize];
    let s = st.sidecar_of(c);
    let now = st.clocks.sidecar(s);
    match cl.phase {
        ClientPhase::Idle if cl.belief.is_none() => {
            if cl.acquires < cfg.max_acquires {
                out.push(ClientAction::Acquire);
            }
            if st.sidecars[s as usize].get(now).is_some() {
                out.push(ClientAction::Get);
            }
        }
        ClientPhase::Holding { lease, wrote, .. } => {
            if cfg.renewals {
                out.push(ClientAction::Renew);
            }
            out.push(ClientAction::Release);
            if cfg.writes && !wrote && st.sidecars[s as usize].may_write(now, lease).is_some() {
                out.push(ClientAction::Write);
            }
        }
        ClientPhase::Acquiring | ClientPhase::Renewing { .. } | ClientPhase::Releasing => {
            out.push(ClientAction::Disconnect);
        }
        _ => {}
    }
}

/// Applies an answer of its sidecar to client `c`.
pub fn told(st: &mut State, c: ClientId, answer: Answer) {
    let cl = &mut st.clients[c as usize];
    match answer {
        Answer::Held {
            lease,
            token,
            until,
        } => {
            cl.phase = ClientPhase::Holding {
                lease,
                token,
                wrote: false,
            };
            cl.belief = Some((lease, until));
            // Tokens told with "held" must increase from lease to lease.
            if let Some((t, l)) = st.last_told {
                if l != lease && token <= t {
                    st.token_went_back = true;
                }
            }
            st.last_told = Some((token, lease));
        }
        Answer::Renewed { until } => {
            if let ClientPhase::Renewing {
                lease,
                token,
                wrote,
            } = cl.phase
            {
                cl.phase = ClientPhase::Holding {
                    lease,
                    token,
                    wrote,
                };
                cl.belief = Some((lease, until));
            }
        }
        Answer::Lost => {
            cl.phase = ClientPhase::Idle;
            cl.belief = None;
        }
        Answer::Failed => {
            // A failed renewal leaves the earlier answer standing.
            cl.phase = match cl.phase {
                ClientPhase::Renewing {
                    lease,
                    token,
                    wrote,
                } => ClientPhase::Holding {
                    lease,
                    token,
                    wrote,
                },
                _ => ClientPhase::Idle,
            };
        }
        Answer::Released => cl.phase = ClientPhase::Idle,
    }
}
