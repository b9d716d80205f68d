//! The model proper: its actions (every step any actor can take) and how
//! each changes the global state.

use stateright::{Model, Property};

use super::client::{self, ClientAction};
use super::clock::{Clocks, Tick};
use super::config::Config;
use super::network::{Msg, Network};
use super::sidecar::{Effects, Sidecar, Task};
use super::state::{Client, ClientId, ClientPhase, SidecarId, State};
use super::{backend::Backend, gateway::Gateway, properties};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Time passes (one tick of true time; see [`Tick`] for the clocks).
    Tick(Tick),
    /// A message in flight arrives.
    Deliver(Msg),
    /// A message in flight is lost.
    Drop(Msg),
    /// A client calls its sidecar (or gives up its call).
    Client(ClientId, ClientAction),
    /// A sidecar task stops waiting for its reply.
    Timeout(SidecarId, Task),
}

pub struct LeaseModel {
    pub cfg: Config,
    /// Also check liveness (costly: see `properties::LIVENESS`).
    pub liveness: bool,
    /// Keep one of each state and its mirror image (`symmetry`); traces
    /// then swap the client–sidecar pairs at will, so must-find runs keep
    /// it off.
    pub symmetric: bool,
}

impl LeaseModel {
    pub fn new(cfg: Config) -> LeaseModel {
        assert!(cfg.ttl > cfg.margin, "a TTL must outlast the margin");
        LeaseModel {
            cfg,
            liveness: false,
            symmetric: false,
        }
    }

    pub fn initial(&self) -> State {
        let sidecars = self.cfg.clients.min(2);
        State {
            clocks: Clocks::new(),
            clients: vec![
                Client {
                    phase: ClientPhase::Idle,
                    belief: None,
                    acquires: 0,
                };
                self.cfg.clients
            ],
            sidecars: vec![Sidecar::default(); sidecars],
            backend: Backend::default(),
            gateway: Gateway::default(),
            network: Network::default(),
            next_lease: 1,
            last_told: None,
            token_went_back: false,
            storage_max: None,
            stale_write_applied: false,
        }
    }

    fn apply_effects(&self, st: &mut State, fx: Effects) {
        for m in fx.send {
            st.network.send(m);
        }
        if let Some((c, answer)) = fx.answer {
            client::told(st, c, answer);
        }
    }

    fn deliver(&self, st: &mut State, m: &Msg) {
        let cfg = &self.cfg;
        match m {
            Msg::Acquire { .. }
            | Msg::VoidAttempt { .. }
            | Msg::Release { .. }
            | Msg::Renew { .. } => {
                let now = st.clocks.backend();
                if let Some(reply) = st.backend.apply(cfg, now, m) {
                    st.network.send(reply);
                }
            }
            Msg::AcquireReply { s, .. }
            | Msg::ReleaseReply { s, .. }
            | Msg::RenewReply { s, .. }
            | Msg::PreregReply { s, .. } => {
                let now = st.clocks.sidecar(*s);
                let mut fx = Effects::default();
                st.sidecars[*s as usize].receive(cfg, now, *s, m, &mut fx);
                self.apply_effects(st, fx);
            }
            Msg::Prereg { .. } | Msg::Write { .. } => {
                if let Some(out) = st.gateway.apply(m) {
                    st.network.send(out);
                }
            }
            Msg::Forward { token } => {
                if st.storage_max.is_some_and(|t| *token < t) {
                    st.stale_write_applied = true;
                }
                st.storage_max = st.storage_max.max(Some(*token));
                st.gateway.applied();
            }
        }
    }

    fn client_step(&self, st: &mut State, c: ClientId, a: ClientAction) {
        let cfg = &self.cfg;
        let s = st.sidecar_of(c);
        let now = st.clocks.sidecar(s);
        let mut fx = Effects::default();
        let sc = &mut st.sidecars[s as usize];
        let cl = &mut st.clients[c as usize];
        match a {
            ClientAction::Acquire => {
                let lease = st.next_lease;
                st.next_lease += 1;
                cl.acquires += 1;
                cl.phase = ClientPhase::Acquiring;
                sc.start_acquire(now, s, c, lease, &mut fx);
            }
            ClientAction::Get => cl.belief = sc.get(now),
            ClientAction::Renew => {
                let ClientPhase::Holding {
                    lease,
                    token,
                    wrote,
                } = cl.phase
                else {
                    unreachable!()
                };
                cl.phase = ClientPhase::Renewing {
                    lease,
                    token,
                    wrote,
                };
                sc.start_renew(now, s, c, lease, &mut fx);
            }
            ClientAction::Release => {
                let ClientPhase::Holding { lease, .. } = cl.phase else {
                    unreachable!()
                };
                cl.phase = ClientPhase::Releasing;
                cl.belief = None;
                sc.start_release(cfg, s, c, lease, &mut fx);
            }
            ClientAction::Write => {
                let ClientPhase::Holding { lease, token, .. } = cl.phase else {
                    unreachable!()
                };
                cl.phase = ClientPhase::Holding {
                    lease,
                    token,
                    wrote: true,
                };
                let token = sc.may_write(now, lease).expect("checked in actions");
                fx.send.push(Msg::Write { c, lease, token });
            }
            ClientAction::Disconnect => {
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
                sc.disconnect(cfg, now, s, c, &mut fx);
            }
        }
        self.apply_effects(st, fx);
    }
}

impl Model for LeaseModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, st: &State, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        let mut ticks = Vec::new();
        st.clocks.ticks(cfg, &mut ticks);
        out.extend(ticks.into_iter().map(Action::Tick));
        let mut seen: Vec<&Msg> = Vec::new();
        for m in &st.network.in_flight {
            if seen.contains(&m) {
                continue; // the same message twice: one choice
            }
            seen.push(m);
            let ready = match m {
                Msg::Prereg { .. } | Msg::Write { .. } => st.gateway.ready(m),
                _ => true,
            };
            if ready {
                out.push(Action::Deliver(m.clone()));
            }
            if cfg.drops && m.droppable() {
                out.push(Action::Drop(m.clone()));
            }
        }
        for c in 0..st.clients.len() {
            let mut acts = Vec::new();
            client::actions(cfg, st, c as ClientId, &mut acts);
            out.extend(acts.into_iter().map(|a| Action::Client(c as ClientId, a)));
        }
        for (s, sc) in st.sidecars.iter().enumerate() {
            for t in &sc.tasks {
                if t.can_time_out() {
                    out.push(Action::Timeout(s as SidecarId, t.clone()));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut st = last.clone();
        match &action {
            Action::Tick(t) => st.tick(&self.cfg, *t),
            Action::Deliver(m) => {
                st.network.take(m);
                self.deliver(&mut st, m);
            }
            Action::Drop(m) => {
                st.network.take(m);
            }
            Action::Client(c, a) => self.client_step(&mut st, *c, *a),
            Action::Timeout(s, t) => {
                let now = st.clocks.sidecar(*s);
                let mut fx = Effects::default();
                st.sidecars[*s as usize].time_out(&self.cfg, now, *s, t, &mut fx);
                self.apply_effects(&mut st, fx);
            }
        }
        st.normalize();
        if self.symmetric {
            st = super::symmetry::representative(st);
        }
        Some(st)
    }

    fn within_boundary(&self, st: &State) -> bool {
        st.network.in_flight.len() <= self.cfg.max_in_flight
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all(self.liveness)
    }
}
