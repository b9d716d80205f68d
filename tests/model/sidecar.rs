//! A sidecar: its record of the key's lease (local deadline on its own
//! clock) and its tasks — request futures (an acquire, a renewal, a
//! release) and the background tasks they leave (the clean-up of an
//! abandoned acquire, a release the client no longer waits for, the
//! runner's undo of a try whose caller gave up).
//!
//! Each function names the code it models; `docs/model.md` has the table.

use super::config::{Config, Mutant};
use super::network::{AcqReply, Msg};
use super::state::{AttemptNo, ClientId, LeaseId, SidecarId, Time, Token};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecState {
    Held,
    /// Marked released before the backend was told (`LeaseTable::releasing`).
    Releasing,
    /// Lost: the backend said so, or a renewal's reply came too late.
    Lost,
}

/// `LeaseRecord`, reduced to what the protocol reads.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Record {
    pub lease: LeaseId,
    pub token: Token,
    /// Local deadline, on this sidecar's clock.
    pub deadline: Time,
    pub state: RecState,
}

impl Record {
    /// `LeaseRecord::is_held` after `expire`: held and inside its deadline.
    pub fn held(&self, now: Time) -> bool {
        self.state == RecState::Held && now < self.deadline
    }
}

/// What an acquire request waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AcqWait {
    /// The backend's answer to try `attempt`.
    Backend(AttemptNo),
    /// The gateway's answer to the pre-registration of `token`.
    Prereg(Token),
}

/// What a clean-up waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CleanupWait {
    /// The try still running when the acquire was dropped.
    Attempt(AttemptNo),
    /// Its release of the lease.
    Release,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Task {
    /// An acquire request of client `c` (`LockManager::acquire`): one
    /// lease id, tries numbered from 1, deadline from the first send.
    Acquire {
        c: ClientId,
        lease: LeaseId,
        first_sent: Time,
        wait: AcqWait,
    },
    /// `release_orphans`: what an acquire that did not hand its lease over
    /// leaves behind.
    Cleanup { lease: LeaseId, wait: CleanupWait },
    /// `release_task`; `c` while the client still waits for it.
    Release { c: Option<ClientId>, lease: LeaseId },
    /// `renew_known`, sent at `sent`.
    Renew {
        c: ClientId,
        lease: LeaseId,
        sent: Time,
    },
    /// Mutant `undo_by_lease`: the runner waits for the late answer of the
    /// abandoned try, then runs `RELEASE` by lease id.
    LateUndo { lease: LeaseId, attempt: AttemptNo },
}

impl Task {
    /// The client waiting for this task, if any.
    pub fn client(&self) -> Option<ClientId> {
        match *self {
            Task::Acquire { c, .. } | Task::Renew { c, .. } => Some(c),
            Task::Release { c, .. } => c,
            _ => None,
        }
    }

    /// Whether the task waits for a reply it may give up on (a timeout).
    pub fn can_time_out(&self) -> bool {
        !matches!(self, Task::LateUndo { .. })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sidecar {
    pub record: Option<Record>,
    pub tasks: Vec<Task>,
}

/// What a sidecar step tells its client (the HTTP answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// "held" with this token, until this deadline (sidecar clock).
    Held {
        lease: LeaseId,
        token: Token,
        until: Time,
    },
    /// Renewed: held until.
    Renewed { until: Time },
    /// `lease_lost`: the client no longer holds.
    Lost,
    /// Any other failure (409 lock_held, 503): nothing held by this call.
    Failed,
    /// Released.
    Released,
}

/// What one sidecar step produced.
#[derive(Default)]
pub struct Effects {
    pub send: Vec<Msg>,
    pub answer: Option<(ClientId, Answer)>,
}

impl Sidecar {
    /// This sidecar's clock advanced `by`.
    pub fn age(&mut self, by: i8, floor: i8) {
        if let Some(r) = self.record.as_mut() {
            super::clock::age(&mut r.deadline, by, floor);
        }
        for t in &mut self.tasks {
            match t {
                Task::Acquire { first_sent: x, .. } | Task::Renew { sent: x, .. } => {
                    super::clock::age(x, by, floor)
                }
                _ => {}
            }
        }
    }

    /// A held record past its deadline is lost (`expire`); tasks in a
    /// canonical order.
    pub fn normalize(&mut self) {
        if let Some(r) = self.record.as_mut() {
            if r.state == RecState::Held && !r.held(0) {
                r.state = RecState::Lost;
            }
        }
        self.tasks.sort();
    }

    fn take_task(&mut self, t: &Task) -> Task {
        let i = self.tasks.iter().position(|x| x == t).expect("task exists");
        self.tasks.remove(i)
    }

    /// `LockManager::hold` + `LeaseTable::insert`: records a lease the
    /// backend granted, deadline from the first send.
    fn hold(&mut self, cfg: &Config, lease: LeaseId, token: Token, first_sent: Time) {
        self.record = Some(Record {
            lease,
            token,
            deadline: cfg.deadline(first_sent),
            state: RecState::Held,
        });
    }

    /// `forget` (release.rs): removes the record if it is `lease`'s.
    fn forget(&mut self, lease: LeaseId) {
        if self.record.as_ref().is_some_and(|r| r.lease == lease) {
            self.record = None;
        }
    }

    /// `LeaseTable::mark_lost`.
    fn mark_lost(&mut self, lease: LeaseId) {
        self.mark(lease, RecState::Lost);
    }

    /// A held record of `lease` stops being held (`LeaseTable::releasing`,
    /// `LeaseTable::mark_lost`).
    fn mark(&mut self, lease: LeaseId, to: RecState) {
        if let Some(r) = self.record.as_mut().filter(|r| r.lease == lease) {
            if r.state == RecState::Held {
                r.state = to;
            }
        }
    }

    /// The runner gave up on try `attempt` of `lease` (`statement_task`'s
    /// abandoned branch): the undo, or the mutant's late undo.
    fn undo(
        &mut self,
        cfg: &Config,
        s: SidecarId,
        lease: LeaseId,
        attempt: AttemptNo,
        fx: &mut Effects,
    ) {
        if cfg.mutant(Mutant::UndoByLease) {
            self.tasks.push(Task::LateUndo { lease, attempt });
        } else {
            fx.send.push(Msg::VoidAttempt { s, lease, attempt });
        }
    }

    /// `Attempts::drop` → `release_orphans`: release `lease` once the try
    /// in flight (if any) has ended.
    fn clean_up(
        &mut self,
        cfg: &Config,
        s: SidecarId,
        lease: LeaseId,
        pending: Option<AttemptNo>,
        fx: &mut Effects,
    ) {
        // `release::stop_holding`: not held here from now on.
        if !cfg.mutant(Mutant::OrphanHeld) {
            self.mark(lease, RecState::Releasing);
        }
        match pending {
            Some(a) => self.tasks.push(Task::Cleanup {
                lease,
                wait: CleanupWait::Attempt(a),
            }),
            None => {
                self.tasks.push(Task::Cleanup {
                    lease,
                    wait: CleanupWait::Release,
                });
                fx.send.push(Msg::Release { s, lease });
            }
        }
    }

    /// `LockManager::acquire` → `try_once`: the first try.
    pub fn start_acquire(
        &mut self,
        now: Time,
        s: SidecarId,
        c: ClientId,
        lease: LeaseId,
        fx: &mut Effects,
    ) {
        self.tasks.push(Task::Acquire {
            c,
            lease,
            first_sent: now,
            wait: AcqWait::Backend(1),
        });
        fx.send.push(Msg::Acquire {
            s,
            lease,
            attempt: 1,
        });
    }

    /// `try_once`'s retry after an unknown outcome, or the acquire's end.
    fn retry_or_fail(
        &mut self,
        cfg: &Config,
        s: SidecarId,
        task: Task,
        attempt: AttemptNo,
        fx: &mut Effects,
    ) {
        let Task::Acquire {
            c,
            lease,
            first_sent,
            ..
        } = task
        else {
            unreachable!()
        };
        if attempt < cfg.max_tries {
            self.tasks.push(Task::Acquire {
                c,
                lease,
                first_sent,
                wait: AcqWait::Backend(attempt + 1),
            });
            fx.send.push(Msg::Acquire {
                s,
                lease,
                attempt: attempt + 1,
            });
        } else {
            fx.answer = Some((c, Answer::Failed));
            self.clean_up(cfg, s, lease, None, fx);
        }
    }

    /// `held_at_answer`: the lease as it stands at the answer.
    fn answer_acquire(
        &mut self,
        cfg: &Config,
        now: Time,
        s: SidecarId,
        c: ClientId,
        lease: LeaseId,
        fx: &mut Effects,
    ) {
        let rec = self.record.as_ref().filter(|r| r.lease == lease);
        match rec {
            Some(r) if r.held(now) => {
                fx.answer = Some((
                    c,
                    Answer::Held {
                        lease,
                        token: r.token,
                        until: r.deadline,
                    },
                ));
            }
            Some(r) if cfg.mutant(Mutant::AnswerAfterDeadline) => {
                fx.answer = Some((
                    c,
                    Answer::Held {
                        lease,
                        token: r.token,
                        until: now + cfg.ttl as i8,
                    },
                ));
            }
            _ => {
                // ExpiredBeforeAnswer: not handed over; the clean-up
                // releases it.
                fx.answer = Some((c, Answer::Failed));
                self.clean_up(cfg, s, lease, None, fx);
            }
        }
    }

    /// `LockManager::release`: the application's release.
    pub fn start_release(
        &mut self,
        cfg: &Config,
        s: SidecarId,
        c: ClientId,
        lease: LeaseId,
        fx: &mut Effects,
    ) {
        if !cfg.mutant(Mutant::ReleaseInRequest) {
            if let Some(r) = self.record.as_mut().filter(|r| r.lease == lease) {
                if r.state == RecState::Held {
                    r.state = RecState::Releasing;
                }
            }
        }
        self.tasks.push(Task::Release { c: Some(c), lease });
        fx.send.push(Msg::Release { s, lease });
    }

    /// `LockManager::renew` → `renew_known`.
    pub fn start_renew(
        &mut self,
        now: Time,
        s: SidecarId,
        c: ClientId,
        lease: LeaseId,
        fx: &mut Effects,
    ) {
        match &self.record {
            Some(r) if r.lease == lease && r.held(now) => {
                self.tasks.push(Task::Renew {
                    c,
                    lease,
                    sent: now,
                });
                fx.send.push(Msg::Renew {
                    s,
                    lease,
                    sent: now,
                });
            }
            _ => fx.answer = Some((c, Answer::Lost)),
        }
    }

    /// `lease_for_write`: whether the proxy stamps a write of `lease`.
    pub fn may_write(&self, now: Time, lease: LeaseId) -> Option<Token> {
        self.record
            .as_ref()
            .filter(|r| r.lease == lease && r.held(now))
            .map(|r| r.token)
    }

    /// `LockManager::get`: "lease (tag) held, until" if the record is held
    /// now.
    pub fn get(&self, now: Time) -> Option<(LeaseId, Time)> {
        self.record
            .as_ref()
            .filter(|r| r.held(now))
            .map(|r| (r.lease, r.deadline))
    }

    /// The client went away: its request future is dropped at its await.
    pub fn disconnect(
        &mut self,
        cfg: &Config,
        now: Time,
        s: SidecarId,
        c: ClientId,
        fx: &mut Effects,
    ) {
        let Some(task) = self.tasks.iter().find(|t| t.client() == Some(c)).cloned() else {
            return;
        };
        self.take_task(&task);
        match task {
            // `Attempts::drop`: the try in flight runs on; then release.
            Task::Acquire { lease, wait, .. } => {
                let pending = match wait {
                    AcqWait::Backend(a) => Some(a),
                    AcqWait::Prereg(_) => None,
                };
                self.clean_up(cfg, s, lease, pending, fx);
            }
            // Its own task: it runs on without the client. (Mutant
            // `release_in_request`: cut short where it stands.)
            Task::Release { lease, .. } if !cfg.mutant(Mutant::ReleaseInRequest) => {
                self.tasks.push(Task::Release { c: None, lease });
            }
            // `RenewalInFlight::drop` → `renewal_unknown`.
            Task::Renew { lease, sent, .. } => self.renewal_unknown(cfg, lease, sent),
            _ => {}
        }
        let _ = now;
    }

    /// `LeaseTable::renewal_unknown`.
    fn renewal_unknown(&mut self, cfg: &Config, lease: LeaseId, sent: Time) {
        if let Some(r) = self
            .record
            .as_mut()
            .filter(|r| r.lease == lease && r.state == RecState::Held)
        {
            r.deadline = r.deadline.min(cfg.deadline(sent));
        }
    }

    /// A task gave up waiting (the runner's or the caller's timeout).
    pub fn time_out(
        &mut self,
        cfg: &Config,
        now: Time,
        s: SidecarId,
        task: &Task,
        fx: &mut Effects,
    ) {
        let task = self.take_task(task);
        match task {
            Task::Acquire {
                wait: AcqWait::Backend(a),
                lease,
                ..
            } => {
                self.undo(cfg, s, lease, a, fx);
                self.retry_or_fail(cfg, s, task, a, fx);
            }
            // `preregister_or_repair`: Failed → release the lease.
            Task::Acquire {
                c,
                lease,
                wait: AcqWait::Prereg(_),
                ..
            } => {
                fx.answer = Some((c, Answer::Failed));
                self.start_release_detached(s, lease, fx);
            }
            Task::Cleanup {
                lease,
                wait: CleanupWait::Attempt(a),
            } => {
                self.undo(cfg, s, lease, a, fx);
                self.clean_up(cfg, s, lease, None, fx);
            }
            Task::Cleanup {
                lease,
                wait: CleanupWait::Release,
            } => self.forget(lease),
            // The first answer is "unknown"; the record stays as it is.
            Task::Release { c, .. } => {
                if let Some(c) = c {
                    fx.answer = Some((c, Answer::Failed));
                }
            }
            Task::Renew { c, lease, sent } => {
                self.renewal_unknown(cfg, lease, sent);
                fx.answer = Some((c, Answer::Failed));
            }
            Task::LateUndo { .. } => {}
        }
        let _ = now;
    }

    /// `release` called by the acquire itself (pre-registration failed):
    /// marked released here first, then told to the backend.
    fn start_release_detached(&mut self, s: SidecarId, lease: LeaseId, fx: &mut Effects) {
        if let Some(r) = self.record.as_mut().filter(|r| r.lease == lease) {
            if r.state == RecState::Held {
                r.state = RecState::Releasing;
            }
        }
        self.tasks.push(Task::Release { c: None, lease });
        fx.send.push(Msg::Release { s, lease });
    }

    /// A reply reached this sidecar.
    pub fn receive(&mut self, cfg: &Config, now: Time, s: SidecarId, m: &Msg, fx: &mut Effects) {
        match *m {
            Msg::AcquireReply {
                lease,
                attempt,
                reply,
                ..
            } => self.acquire_reply(cfg, now, s, lease, attempt, reply, fx),
            Msg::PreregReply { lease, ok, .. } => {
                let Some(task) = self
                    .tasks
                    .iter()
                    .find(|t| matches!(t, Task::Acquire { lease: l, wait: AcqWait::Prereg(_), .. } if *l == lease))
                    .cloned()
                else {
                    return;
                };
                self.take_task(&task);
                let Task::Acquire { c, .. } = task else {
                    unreachable!()
                };
                if ok {
                    self.answer_acquire(cfg, now, s, c, lease, fx);
                } else {
                    fx.answer = Some((c, Answer::Failed));
                    self.start_release_detached(s, lease, fx);
                }
            }
            Msg::ReleaseReply { lease, owned, .. } => {
                let Some(task) = self
                    .tasks
                    .iter()
                    .find(|t| match t {
                        Task::Release { lease: l, .. } => *l == lease,
                        Task::Cleanup {
                            lease: l,
                            wait: CleanupWait::Release,
                        } => *l == lease,
                        _ => false,
                    })
                    .cloned()
                else {
                    return;
                };
                self.take_task(&task);
                self.forget(lease);
                if let Task::Release { c: Some(c), .. } = task {
                    fx.answer = Some((
                        c,
                        if owned {
                            Answer::Released
                        } else {
                            Answer::Lost
                        },
                    ));
                }
            }
            Msg::RenewReply {
                lease, sent, owned, ..
            } => {
                let Some(task) = self
                    .tasks
                    .iter()
                    .find(|t| matches!(t, Task::Renew { lease: l, sent: x, .. } if *l == lease && *x == sent))
                    .cloned()
                else {
                    return;
                };
                self.take_task(&task);
                let Task::Renew { c, .. } = task else {
                    unreachable!()
                };
                if !owned {
                    self.mark_lost(lease);
                    fx.answer = Some((c, Answer::Lost));
                    return;
                }
                // `LeaseTable::renewed`: a reply after the deadline is late.
                match self.record.as_mut().filter(|r| r.lease == lease) {
                    Some(r) if r.held(now) => {
                        r.deadline = cfg.deadline(sent);
                        fx.answer = Some((c, Answer::Renewed { until: r.deadline }));
                    }
                    Some(_) => {
                        // `lost_after_late_reply` → `release_in_background`.
                        self.mark_lost(lease);
                        self.tasks.push(Task::Cleanup {
                            lease,
                            wait: CleanupWait::Release,
                        });
                        fx.send.push(Msg::Release { s, lease });
                        fx.answer = Some((c, Answer::Lost));
                    }
                    None => fx.answer = Some((c, Answer::Lost)),
                }
            }
            _ => unreachable!("not a sidecar message: {m:?}"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn acquire_reply(
        &mut self,
        cfg: &Config,
        now: Time,
        s: SidecarId,
        lease: LeaseId,
        attempt: AttemptNo,
        reply: AcqReply,
        fx: &mut Effects,
    ) {
        let waiting = self.tasks.iter().find(|t| match t {
            Task::Acquire {
                lease: l,
                wait: AcqWait::Backend(a),
                ..
            } => *l == lease && *a == attempt,
            Task::Cleanup {
                lease: l,
                wait: CleanupWait::Attempt(a),
            } => *l == lease && *a == attempt,
            Task::LateUndo {
                lease: l,
                attempt: a,
            } => *l == lease && *a == attempt,
            _ => false,
        });
        let Some(task) = waiting.cloned() else {
            // Its caller gave up: the runner dropped the answer (and sent
            // the undo when it gave up).
            return;
        };
        self.take_task(&task);
        match task {
            Task::Acquire { c, first_sent, .. } => match reply {
                AcqReply::Acquired(token) => {
                    self.hold(cfg, lease, token, first_sent);
                    if cfg.preregister {
                        self.tasks.push(Task::Acquire {
                            c,
                            lease,
                            first_sent,
                            wait: AcqWait::Prereg(token),
                        });
                        fx.send.push(Msg::Prereg { s, lease, token });
                    } else {
                        self.answer_acquire(cfg, now, s, c, lease, fx);
                    }
                }
                AcqReply::Held => {
                    fx.answer = Some((c, Answer::Failed));
                    // Only the first try's "held" proves the lease never
                    // held the key (`not_taken`).
                    if attempt > 1 {
                        self.clean_up(cfg, s, lease, None, fx);
                    }
                }
                AcqReply::Voided => self.retry_or_fail(cfg, s, task, attempt, fx),
            },
            Task::Cleanup { .. } => self.clean_up(cfg, s, lease, None, fx),
            Task::LateUndo { .. } => {
                if reply != AcqReply::Voided {
                    fx.send.push(Msg::Release { s, lease });
                }
            }
            _ => unreachable!(),
        }
    }
}
