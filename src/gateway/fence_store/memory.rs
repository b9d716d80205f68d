//! In-process fence store (`fencer dev`, tests): the marks in a map. Not
//! durable, not shared between replicas — so it needs no in-flight stamps:
//! the key's turn in this process ([`crate::gateway::key_queue`]) is all
//! the serialization there is.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{decide, Admitted, Decision, FenceError, FenceStore, Mode, Presented, Stamp};

#[derive(Default)]
struct StoredMark {
    /// 0 with an empty lease: no write lease seen yet (only readers).
    token: u64,
    lease: String,
    seq: u64,
    read_token: u64,
}

#[derive(Default)]
pub struct MemoryFences {
    marks: Mutex<HashMap<String, StoredMark>>,
}

#[async_trait]
impl FenceStore for MemoryFences {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn admit(
        &self,
        key: &str,
        presented: Presented<'_>,
        _stamp: Option<&Stamp>,
        _deadline: Instant,
    ) -> Result<Admitted, FenceError> {
        let Presented {
            token,
            lease,
            seq,
            mode,
        } = presented;
        let mut marks = self.marks.lock().expect("fence map poisoned");
        let stored = marks.get(key).map(|m| super::Mark {
            token: m.token,
            lease: m.lease.as_str(),
            seq: m.seq,
            read_token: m.read_token,
        });
        let previous = stored.map(|m| m.highest());
        let decision = decide(stored, token, lease, seq, mode);
        if decision.writes_mark(seq) {
            let m = marks.entry(key.to_owned()).or_default();
            match mode {
                Mode::Read => m.read_token = token,
                Mode::Write => {
                    if decision == Decision::Advanced {
                        m.token = token;
                        m.lease = lease.to_owned();
                    }
                    m.seq = seq.unwrap_or(0);
                }
            }
        }
        Ok(Admitted { decision, previous })
    }

    async fn finish(&self, _key: &str, _stamp_id: &str) -> Result<(), FenceError> {
        Ok(())
    }

    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError> {
        let marks = self.marks.lock().expect("fence map poisoned");
        Ok(marks
            .get(key)
            .filter(|m| !m.lease.is_empty())
            .map(|m| (m.token, m.lease.clone())))
    }

    async fn ping(&self) -> Result<(), FenceError> {
        Ok(())
    }
}
