//! In-process fence store (`fencer dev`, tests): the marks in a map. Not
//! durable, not shared between replicas — so it needs no in-flight stamps:
//! the key's turn in this process ([`crate::gateway::key_queue`]) is all
//! the serialization there is.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{decide, Admitted, Decision, FenceError, FenceStore, Stamp};

struct StoredMark {
    token: u64,
    lease: String,
    seq: u64,
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
        token: u64,
        lease: &str,
        seq: Option<u64>,
        _stamp: Option<&Stamp>,
        _deadline: Instant,
    ) -> Result<Admitted, FenceError> {
        let mut marks = self.marks.lock().expect("fence map poisoned");
        let previous = marks.get(key).map(|m| m.token);
        let stored = marks.get(key).map(|m| super::Mark {
            token: m.token,
            lease: m.lease.as_str(),
            seq: m.seq,
        });
        let decision = decide(stored, token, lease, seq);
        if decision.writes_mark(seq) {
            let m = marks.entry(key.to_owned()).or_insert(StoredMark {
                token,
                lease: String::new(),
                seq: 0,
            });
            if decision == Decision::Advanced {
                m.token = token;
                m.lease = lease.to_owned();
            }
            m.seq = seq.unwrap_or(0);
        }
        Ok(Admitted { decision, previous })
    }

    async fn finish(&self, _key: &str, _stamp_id: &str) -> Result<(), FenceError> {
        Ok(())
    }

    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError> {
        let marks = self.marks.lock().expect("fence map poisoned");
        Ok(marks.get(key).map(|m| (m.token, m.lease.clone())))
    }

    async fn ping(&self) -> Result<(), FenceError> {
        Ok(())
    }
}
