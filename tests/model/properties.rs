//! What must hold in every reachable state, and the liveness check.

use stateright::{Model, Property};

use super::client::ClientAction;
use super::clock::Tick;
use super::lease_model::{Action, LeaseModel};
use super::state::{ClientId, ClientPhase, State};

pub const MUTUAL_EXCLUSION: &str = "never two leases told \"held\" at once";
pub const TOKENS_INCREASE: &str = "tokens told with \"held\" increase from lease to lease";
pub const FENCED_WRITES: &str = "no write applied below a token already applied";

/// Number of leases some client is told, at this instant of true time,
/// hold the key. Every state is an instant of true time and every belief
/// ends at a deadline on its sidecar's clock, so "no two belief intervals
/// overlap on true time" is "never two at once". Counted by lease, not by
/// client: two clients of one sidecar both told (by acquire and by `GET`)
/// that the same lease holds are one holder.
pub fn believers(st: &State) -> usize {
    let mut leases: Vec<_> = (0..st.clients.len())
        .filter(|c| st.believes(*c as ClientId))
        .map(|c| st.clients[c].belief.unwrap().0)
        .collect();
    leases.sort();
    leases.dedup();
    leases.len()
}

pub const LIVENESS: &str = "a fair schedule grants the key to somebody";

pub fn all(liveness: bool) -> Vec<Property<LeaseModel>> {
    let mut p = vec![
        Property::always(MUTUAL_EXCLUSION, |_, st: &State| believers(st) <= 1),
        Property::always(TOKENS_INCREASE, |_, st: &State| !st.token_went_back),
        Property::always(FENCED_WRITES, |_, st: &State| !st.stale_write_applied),
    ];
    if liveness {
        p.push(Property::always(LIVENESS, |m: &LeaseModel, st: &State| {
            granted_under_fairness(m, st, fair_steps(m))
        }));
    }
    p
}

/// Steps a fair schedule gets: enough for a lease to run out on every
/// clock and for a full acquire after it.
pub fn fair_steps(m: &LeaseModel) -> usize {
    4 * (m.cfg.ttl as usize + 2 * m.cfg.drift as usize) + 4 * m.cfg.max_in_flight + 24
}

/// Liveness, checked as: from `st`, if from now on nothing is lost, every
/// message is delivered, a caller times out only when no reply can come
/// any more, clocks run evenly and idle
/// clients ask for the key, some client is told "held" within `steps`
/// steps. This is the fairness the promise assumes; stateright's own
/// `eventually` does not take fairness, so it cannot state it.
pub fn granted_under_fairness(model: &LeaseModel, st: &State, steps: usize) -> bool {
    fair_run(model, st, steps, &mut None)
}

/// The fair schedule from `st`; its steps go to `log` if given.
pub fn fair_run(
    model: &LeaseModel,
    st: &State,
    steps: usize,
    log: &mut Option<Vec<String>>,
) -> bool {
    let mut st = st.clone();
    let mut cfg_model = LeaseModel::new(model.cfg.clone());
    cfg_model.cfg.max_acquires = u8::MAX / 2;
    // Rounds: deliver what is in flight (a caller gives up only when
    // nothing it waits for can come any more), then every idle client asks
    // once, then time passes one tick.
    let mut asked = vec![false; st.clients.len()];
    for _ in 0..steps {
        if believers(&st) > 0 {
            return true;
        }
        let mut acts = Vec::new();
        cfg_model.actions(&st, &mut acts);
        let deliver = acts.iter().find(|a| matches!(a, Action::Deliver(_)));
        let timeout = acts.iter().find(|a| matches!(a, Action::Timeout(..)));
        let ask = acts.iter().find(|a| {
            matches!(a, Action::Client(c, ClientAction::Acquire)
                if st.clients[*c as usize].phase == ClientPhase::Idle && !asked[*c as usize])
        });
        let pick = match (deliver, timeout, ask) {
            (Some(a), _, _) | (None, Some(a), _) => a.clone(),
            (None, None, Some(a)) => {
                if let Action::Client(c, _) = a {
                    asked[*c as usize] = true;
                }
                a.clone()
            }
            _ => {
                asked.iter_mut().for_each(|x| *x = false);
                Action::Tick(Tick::Even)
            }
        };
        if let Some(l) = log.as_mut() {
            l.push(super::trace::action(&st, &pick));
        }
        match cfg_model.next_state(&st, pick) {
            Some(next) => st = next,
            None => return false,
        }
    }
    believers(&st) > 0
}
