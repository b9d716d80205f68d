//! In-process fence store (`fencer dev`, tests): a per-key async mutex
//! around the key's mark. Not durable, not shared between replicas.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::{decide, Decision, FenceError, FenceStore, KeyGuard};

#[derive(Default)]
struct Mark {
    token: u64,
    lease: String,
    seq: u64,
}

#[derive(Default)]
pub struct MemoryFences {
    keys: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Mark>>>>,
}

impl MemoryFences {
    fn slot(&self, key: &str) -> Arc<tokio::sync::Mutex<Mark>> {
        self.keys
            .lock()
            .expect("fence map poisoned")
            .entry(key.to_owned())
            .or_default()
            .clone()
    }
}

#[async_trait]
impl FenceStore for MemoryFences {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn enter(
        &self,
        key: &str,
        token: u64,
        lease: &str,
        seq: Option<u64>,
        wait: Duration,
    ) -> Result<(Decision, KeyGuard), FenceError> {
        let slot = self.slot(key);
        let mut guard = tokio::time::timeout(wait, slot.lock_owned())
            .await
            .map_err(|_| FenceError::Busy)?;
        let stored = (guard.token > 0).then(|| super::Mark {
            token: guard.token,
            lease: guard.lease.as_str(),
            seq: guard.seq,
        });
        let decision = decide(stored, token, lease, seq);
        if decision.writes_mark(seq) {
            if decision == Decision::Advanced {
                guard.token = token;
                guard.lease = lease.to_owned();
            }
            guard.seq = seq.unwrap_or(0);
        }
        Ok((decision, KeyGuard::new(guard)))
    }

    async fn highest(&self, key: &str) -> Result<Option<(u64, String)>, FenceError> {
        let slot = self.slot(key);
        let mark = slot.lock().await;
        Ok((mark.token > 0).then(|| (mark.token, mark.lease.clone())))
    }

    async fn ping(&self) -> Result<(), FenceError> {
        Ok(())
    }
}
