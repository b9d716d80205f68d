//! fencer's lease protocol, model-checked exhaustively with `stateright`
//! (issue 28 items 3 and 4; `docs/model.md`).
//!
//! Two clients (three with `FENCER_MODEL_CLIENTS=3`) on two sidecars, one
//! PostgreSQL-like backend, a gateway with its storage, and a network that
//! delays, reorders and drops; clocks drift within a stated bound. CI runs
//! the fixed protocol to a stated depth (every property holds in every
//! state), then each issue-26 defect put back into the model (the real
//! code's mutants), each of which the checker must find — the shortest
//! trace (breadth-first) is printed.
//!
//! Deeper: `FENCER_MODEL_DEPTH=24 cargo test --release --test model --
//! --nocapture fixed_protocol`. Other knobs: `config.rs`.

#[path = "model/backend.rs"]
mod backend;
#[path = "model/client.rs"]
mod client;
#[path = "model/clock.rs"]
mod clock;
#[path = "model/config.rs"]
mod config;
#[path = "model/gateway.rs"]
mod gateway;
#[path = "model/lease_model.rs"]
mod lease_model;
#[path = "model/network.rs"]
mod network;
#[path = "model/properties.rs"]
mod properties;
#[path = "model/sidecar.rs"]
mod sidecar;
#[path = "model/state.rs"]
mod state;
#[path = "model/symmetry.rs"]
mod symmetry;
#[path = "model/table.rs"]
mod table;
#[path = "model/trace.rs"]
mod trace;

use std::time::Instant;

use stateright::{Checker, HasDiscoveries, Model};

use config::{Config, Mutant};
use lease_model::LeaseModel;

/// The depth CI checks the fixed protocol to: every path of this many
/// steps (actions) from the start. (stateright's `target_max_depth` counts
/// the initial state as depth 1 and does not check states at the target.)
const CI_DEPTH: usize = 12;
/// The depth within which each mutant's counterexample must be found.
const MUTANT_DEPTH: usize = 11;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn threads() -> usize {
    env_usize("FENCER_MODEL_THREADS", 1)
}

struct Run {
    states: usize,
    unique: usize,
    depth: usize,
    secs: f64,
}

impl Run {
    /// What a finished check explored, and how long it took.
    fn of<M: Model>(checker: &impl Checker<M>, depth: usize, started: Instant) -> Run {
        Run {
            states: checker.state_count(),
            unique: checker.unique_state_count(),
            depth,
            secs: started.elapsed().as_secs_f64(),
        }
    }
}

fn report(what: &str, r: &Run) {
    println!(
        "model {what}: {} states explored, {} unique, every path of up to {} steps, {:.1} s",
        r.states, r.unique, r.depth, r.secs
    );
}

/// Checks the fixed protocol in `cfg` to `depth` steps: every property in
/// every state.
fn check_fixed(what: &str, cfg: Config, depth: usize) {
    println!("model config ({what}): {cfg:?}, depth {depth}");
    let started = Instant::now();
    let mut model = LeaseModel::new(cfg);
    model.symmetric = std::env::var("FENCER_MODEL_SYMMETRY").is_ok_and(|v| v == "1");
    let checker = model
        .checker()
        .threads(threads())
        .target_max_depth(depth + 2)
        .spawn_bfs()
        .join();
    let run = Run::of(&checker, depth, started);
    report(what, &run);
    for name in [
        properties::MUTUAL_EXCLUSION,
        properties::TOKENS_INCREASE,
        properties::FENCED_WRITES,
    ] {
        if let Some(p) = checker.discovery(name) {
            panic!(
                "the fixed protocol breaks \"{name}\":\n{}",
                trace::path(checker.model(), &p)
            );
        }
    }
    assert!(checker.is_done(), "the check did not finish");
}

/// Everything on: pre-registration, renewals, writes through the gateway.
#[test]
fn fixed_protocol_holds_every_property_to_the_stated_depth() {
    let depth = env_usize("FENCER_MODEL_DEPTH", CI_DEPTH);
    check_fixed("fixed", Config::from_env(), depth);
}

/// The configurations the mutants are found in, fixed: no counterexample
/// at the depth where each mutant's is found.
#[test]
fn fixed_protocol_holds_where_the_mutants_fail() {
    let depth = env_usize("FENCER_MODEL_MUTANT_DEPTH", MUTANT_DEPTH);
    check_fixed(
        "fixed, mutants' configuration",
        Config::from_env().small(),
        depth,
    );
    let mut with_prereg = Config::from_env().small();
    with_prereg.preregister = true;
    check_fixed("fixed, orphan_held's configuration", with_prereg, depth);
}

/// Runs the model with `mutant` put back; returns the counterexample to
/// mutual exclusion, printed.
fn must_find(mutant: Mutant) -> String {
    let mut cfg = Config::from_env().small().with_mutant(mutant);
    if mutant == Mutant::OrphanHeld {
        // Its window is the pre-registration.
        cfg.preregister = true;
    }
    let depth = env_usize("FENCER_MODEL_MUTANT_DEPTH", MUTANT_DEPTH);
    let started = Instant::now();
    // One thread: breadth-first in order, so the trace is a shortest one.
    let checker = LeaseModel::new(cfg)
        .checker()
        .threads(1)
        .target_max_depth(depth + 2)
        .finish_when(HasDiscoveries::AnyOf(
            [properties::MUTUAL_EXCLUSION].into_iter().collect(),
        ))
        .spawn_bfs()
        .join();
    let run = Run::of(&checker, depth, started);
    println!(
        "model {}: breadth-first up to {depth} steps, stopped at the first counterexample: {} states explored, {} unique, {:.1} s",
        mutant.name(), run.states, run.unique, run.secs
    );
    let Some(p) = checker.discovery(properties::MUTUAL_EXCLUSION) else {
        panic!(
            "mutant {}: no two holders found within depth {depth}: the model does not see the defect",
            mutant.name()
        );
    };
    let text = trace::path(checker.model(), &p);
    println!(
        "mutant {}: two holders after {} steps:\n{text}",
        mutant.name(),
        p.clone().into_actions().len()
    );
    text
}

#[test]
fn undo_by_lease_is_found() {
    let t = must_find(Mutant::UndoByLease);
    assert!(t.contains("try 2"), "not the retry seam:\n{t}");
}

#[test]
fn answer_after_deadline_is_found() {
    must_find(Mutant::AnswerAfterDeadline);
}

#[test]
fn release_in_request_is_found() {
    let t = must_find(Mutant::ReleaseInRequest);
    assert!(t.contains("disconnects"), "not the disconnect seam:\n{t}");
}

/// The seam this model found in the code before it (issue 28): an
/// acquire dropped during pre-registration left its lease "held" here.
#[test]
fn orphan_held_is_found() {
    let t = must_find(Mutant::OrphanHeld);
    assert!(t.contains("GET"), "not the seam:\n{t}");
}

/// Liveness under fairness (see `properties::granted_under_fairness`):
/// checked from every state reached within a smaller depth (each check
/// plays a fair schedule forward, so it costs more per state).
#[test]
fn a_free_key_is_granted_under_fairness() {
    let cfg = Config::from_env();
    let depth = env_usize("FENCER_MODEL_LIVENESS_DEPTH", 10);
    let started = Instant::now();
    let mut model = LeaseModel::new(cfg);
    model.liveness = true;
    let checker = model
        .checker()
        .threads(threads())
        .target_max_depth(depth + 2)
        .spawn_bfs()
        .join();
    let run = Run::of(&checker, depth, started);
    report("liveness", &run);
    if let Some(p) = checker.discovery(properties::LIVENESS) {
        let mut log = Some(Vec::new());
        let m = checker.model();
        properties::fair_run(m, p.last_state(), properties::fair_steps(m), &mut log);
        panic!(
            "from this state a fair schedule grants nobody:\n{}\nthe fair schedule then: {}\n{}",
            trace::path(m, &p),
            log.unwrap().join("; "),
            trace::state_at(p.last_state(), 0)
        );
    }
}

#[test]
fn the_mapping_table_names_real_functions() {
    table::check();
}
