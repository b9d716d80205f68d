//! What one run of the model checks: sizes, timings, and which of the
//! issue-26 defects (the real code's mutants, `src/mutants.rs`) are put back.
//!
//! Every number is in ticks of the model's discrete clocks; a TTL of a few
//! ticks keeps the state space small enough to check exhaustively.

/// A defect of the real code put back into the model, mirroring the
/// `FENCER_MUTANT` of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// The undo of an abandoned acquire try releases by lease id, after
    /// the try's late answer (`void_attempt` with `after_answer`).
    UndoByLease,
    /// An acquire answers "held" with its full TTL even when the lease ran
    /// out before the answer (`held_at_answer`).
    AnswerAfterDeadline,
    /// A release lives in the client's request: the lease stays "held"
    /// here until the backend answered, and a client that disconnects cuts
    /// it short (`LockManager::release`).
    ReleaseInRequest,
    /// Not a `FENCER_MUTANT`: the code before this model found the seam
    /// (issue 28). An acquire dropped during pre-registration left its
    /// lease "held" in the table while its clean-up released it in the
    /// backend (`Attempts::drop` without `release::stop_holding`).
    OrphanHeld,
}

impl Mutant {
    pub fn name(self) -> &'static str {
        match self {
            Mutant::UndoByLease => "undo_by_lease",
            Mutant::AnswerAfterDeadline => "answer_after_deadline",
            Mutant::ReleaseInRequest => "release_in_request",
            Mutant::OrphanHeld => "orphan_held (before issue 28)",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// Clients; client `c` talks to sidecar `c % 2`.
    pub clients: usize,
    /// The TTL every acquire and renewal asks for, in ticks.
    pub ttl: u8,
    /// How far (ticks) the backend's clock may be off true time, moving at
    /// most one tick per tick against it (`clock.rs`): over any interval a
    /// sidecar's clock and the backend's drift apart by at most `2 * drift`.
    pub drift: u8,
    /// What the sidecar takes off the TTL for its local deadline (the real
    /// `drift_ratio * ttl + safety_margin`): must cover `2 * drift`.
    pub margin: u8,
    /// Tries of one acquire (the real `ACQUIRE_RETRIES + 1` is 3).
    pub max_tries: u8,
    /// Messages in flight at once, at most (states beyond are not explored).
    pub max_in_flight: usize,
    /// Acquires per client, at most (bounds the lease ids).
    pub max_acquires: u8,
    /// The sidecar pre-registers each new token at the gateway before it
    /// answers.
    pub preregister: bool,
    /// Holders write through the gateway (the fencing property).
    pub writes: bool,
    /// Holders renew (manually, through the API).
    pub renewals: bool,
    /// The network may drop messages (besides delaying and reordering).
    pub drops: bool,
    pub mutant: Option<Mutant>,
}

impl Config {
    /// The configuration CI checks; `FENCER_MODEL_*` variables change it.
    pub fn from_env() -> Config {
        let n = |name: &str, default: u64| -> u64 {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let b = |name: &str, default: bool| -> bool {
            std::env::var(name)
                .map(|v| v == "1" || v == "true")
                .unwrap_or(default)
        };
        let drift = n("FENCER_MODEL_DRIFT", 1) as u8;
        Config {
            clients: n("FENCER_MODEL_CLIENTS", 2) as usize,
            ttl: n("FENCER_MODEL_TTL", 3) as u8,
            drift,
            margin: n("FENCER_MODEL_MARGIN", 2 * u64::from(drift)) as u8,
            max_tries: n("FENCER_MODEL_TRIES", 2) as u8,
            max_in_flight: n("FENCER_MODEL_IN_FLIGHT", 3) as usize,
            max_acquires: n("FENCER_MODEL_ACQUIRES", 2) as u8,
            preregister: b("FENCER_MODEL_PREREGISTER", true),
            writes: b("FENCER_MODEL_WRITES", true),
            renewals: b("FENCER_MODEL_RENEWALS", true),
            drops: b("FENCER_MODEL_DROPS", false),
            mutant: None,
        }
    }

    /// The smaller configuration the mutants are searched in (and the
    /// fixed protocol checked in to the same depth): no pre-registration,
    /// writes or renewals, so a counterexample is a few steps shorter and
    /// the search fits CI. `FENCER_MODEL_FULL=1` keeps everything on.
    pub fn small(mut self) -> Config {
        if std::env::var("FENCER_MODEL_FULL").is_ok_and(|v| v == "1") {
            return self;
        }
        self.preregister = false;
        self.writes = false;
        self.renewals = false;
        self
    }

    pub fn with_mutant(mut self, m: Mutant) -> Config {
        self.mutant = Some(m);
        self
    }

    pub fn mutant(&self, m: Mutant) -> bool {
        self.mutant == Some(m)
    }

    /// The sidecar's local deadline of a lease whose request was sent at
    /// `sent` (its own clock): `LeaseTable::deadline`.
    pub fn deadline(&self, sent: i8) -> i8 {
        sent + self.ttl as i8 - self.margin as i8
    }
}
