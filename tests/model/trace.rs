//! Counterexample traces in words: one line per step, with the clocks and
//! what each actor holds after it.

use stateright::Path;

use super::client::ClientAction;
use super::clock::Tick;
use super::lease_model::{Action, LeaseModel};
use super::network::{AcqReply, Msg};
use super::sidecar::{AcqWait, CleanupWait, Task};
use super::state::State;

pub fn action(_st: &State, a: &Action) -> String {
    match a {
        Action::Tick(Tick::Even) => "tick".into(),
        Action::Tick(Tick::BackendSlow) => "tick (the backend's clock stands still)".into(),
        Action::Tick(Tick::BackendFast) => "tick (the backend's clock advances 2)".into(),
        Action::Deliver(m) => format!("deliver {}", msg(m)),
        Action::Drop(m) => format!("drop {}", msg(m)),
        Action::Client(c, a) => {
            let what = match a {
                ClientAction::Acquire => "acquire",
                ClientAction::Get => "GET (answered held)",
                ClientAction::Renew => "renew",
                ClientAction::Release => "release",
                ClientAction::Write => "write through the proxy",
                ClientAction::Disconnect => "disconnects mid-call",
            };
            format!("client{c}: {what}")
        }
        Action::Timeout(s, t) => format!("sidecar{s}: timeout of {}", task(t)),
    }
}

fn msg(m: &Msg) -> String {
    match m {
        Msg::Acquire { s, lease, attempt } => {
            format!("sidecar{s}→backend acquire(L{lease}, try {attempt})")
        }
        Msg::VoidAttempt { s, lease, attempt } => {
            format!("sidecar{s}→backend void_attempt(L{lease}, try {attempt})")
        }
        Msg::Release { s, lease } => format!("sidecar{s}→backend release(L{lease})"),
        Msg::Renew { s, lease, sent } => format!("sidecar{s}→backend renew(L{lease}, sent {sent})"),
        Msg::AcquireReply {
            s,
            lease,
            attempt,
            reply,
        } => {
            let r = match reply {
                AcqReply::Acquired(t) => format!("acquired token {t}"),
                AcqReply::Held => "held by another".into(),
                AcqReply::Voided => "voided".into(),
            };
            format!("backend→sidecar{s} L{lease} try {attempt}: {r}")
        }
        Msg::ReleaseReply { s, lease, owned } => format!(
            "backend→sidecar{s} release(L{lease}): {}",
            if *owned { "released" } else { "not held" }
        ),
        Msg::RenewReply {
            s, lease, owned, ..
        } => format!(
            "backend→sidecar{s} renew(L{lease}): {}",
            if *owned { "renewed" } else { "not held" }
        ),
        Msg::Prereg { s, lease, token } => {
            format!("sidecar{s}→gateway preregister(token {token}, L{lease})")
        }
        Msg::PreregReply { s, lease, ok } => format!(
            "gateway→sidecar{s} preregister(L{lease}): {}",
            if *ok { "ok" } else { "stale" }
        ),
        Msg::Write { c, lease, token } => {
            format!("proxy of client{c}→gateway write(token {token}, L{lease})")
        }
        Msg::Forward { token } => format!("gateway→storage write(token {token})"),
    }
}

fn task(t: &Task) -> String {
    match t {
        Task::Acquire {
            c,
            lease,
            wait: AcqWait::Backend(a),
            ..
        } => format!("client{c}'s acquire (L{lease}, try {a})"),
        Task::Acquire {
            c,
            lease,
            wait: AcqWait::Prereg(_),
            ..
        } => format!("client{c}'s acquire (L{lease}, pre-registration)"),
        Task::Cleanup {
            lease,
            wait: CleanupWait::Attempt(a),
        } => format!("clean-up of L{lease} (waiting for try {a})"),
        Task::Cleanup {
            lease,
            wait: CleanupWait::Release,
        } => format!("clean-up of L{lease} (release)"),
        Task::Release { lease, .. } => format!("release of L{lease}"),
        Task::Renew { lease, .. } => format!("renewal of L{lease}"),
        Task::LateUndo { lease, attempt } => format!("late undo of L{lease} try {attempt}"),
    }
}

/// What the state says, briefly, at true time `t` (times in brackets are
/// relative to the clock they are on: +1 = in one tick).
pub fn state_at(st: &State, t: u32) -> String {
    let row = match st.backend.holder {
        Some((l, a, exp)) => format!("row L{l}/try {a} expires {exp:+}"),
        None => "row free".into(),
    };
    let recs: Vec<String> = st
        .sidecars
        .iter()
        .enumerate()
        .map(|(i, s)| match &s.record {
            Some(r) => format!(
                "s{i}: L{} tok {} {:?} deadline {:+}",
                r.lease, r.token, r.state, r.deadline
            ),
            None => format!("s{i}: -"),
        })
        .collect();
    let beliefs: Vec<String> = (0..st.clients.len())
        .filter(|c| st.believes(*c as u8))
        .map(|c| {
            let (l, u) = st.clients[c].belief.unwrap();
            format!("client{c} (L{l}) until {u:+}")
        })
        .collect();
    format!(
        "[t={t} backend clock {:+} | {} | {} | told held: {}]",
        st.clocks.backend_offset,
        row,
        recs.join(", "),
        if beliefs.is_empty() {
            "nobody".into()
        } else {
            beliefs.join(", ")
        }
    )
}

/// The whole path, numbered: each step, then the state after it.
pub fn path(_model: &LeaseModel, p: &Path<State, Action>) -> String {
    let steps = p.clone().into_vec();
    let mut t = 0;
    let mut out = format!("    {}\n", state_at(&steps[0].0, t));
    for (i, (_, a)) in steps.iter().enumerate() {
        if let (Some(a), Some((next, _))) = (a, steps.get(i + 1)) {
            if matches!(a, Action::Tick(_)) {
                t += 1;
            }
            out.push_str(&format!(
                "{:>2}. {}\n    {}\n",
                i + 1,
                action(&steps[i].0, a),
                state_at(next, t)
            ));
        }
    }
    out
}
