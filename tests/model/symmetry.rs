//! Symmetry reduction for the pass run: with two clients, client0 with
//! sidecar0 and client1 with sidecar1 are interchangeable, so a state and
//! its mirror image are one situation. `next_state` keeps whichever of the
//! two hashes lower (stateright 0.31 reduces symmetry only in its
//! depth-first checker, which is not exhaustive to a depth bound).

use std::hash::{Hash, Hasher};

use super::network::Msg;
use super::sidecar::Task;
use super::state::State;

fn swap(x: u8) -> u8 {
    match x {
        0 => 1,
        1 => 0,
        other => other,
    }
}

fn mirror_msg(m: &mut Msg) {
    match m {
        Msg::Acquire { s, .. }
        | Msg::VoidAttempt { s, .. }
        | Msg::Release { s, .. }
        | Msg::Renew { s, .. }
        | Msg::AcquireReply { s, .. }
        | Msg::ReleaseReply { s, .. }
        | Msg::RenewReply { s, .. }
        | Msg::Prereg { s, .. }
        | Msg::PreregReply { s, .. } => *s = swap(*s),
        Msg::Write { c, .. } => *c = swap(*c),
        Msg::Forward { .. } => {}
    }
}

fn mirror_task(t: &mut Task) {
    match t {
        Task::Acquire { c, .. } | Task::Renew { c, .. } => *c = swap(*c),
        Task::Release { c: Some(c), .. } => *c = swap(*c),
        _ => {}
    }
}

/// The state with the two client–sidecar pairs swapped.
pub fn mirror(st: &State) -> State {
    let mut m = st.clone();
    m.clients.swap(0, 1);
    m.sidecars.swap(0, 1);
    for msg in &mut m.network.in_flight {
        mirror_msg(msg);
    }
    for s in &mut m.sidecars {
        for t in &mut s.tasks {
            mirror_task(t);
        }
    }
    m.normalize();
    m
}

fn hash_of(st: &State) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    st.hash(&mut h);
    h.finish()
}

/// One representative of `st` and its mirror image.
pub fn representative(st: State) -> State {
    if st.clients.len() != 2 || st.sidecars.len() != 2 {
        return st;
    }
    let m = mirror(&st);
    if hash_of(&m) < hash_of(&st) {
        m
    } else {
        st
    }
}
