//! Readers and writers of a few keys at once through one sidecar (issue 33
//! item 2): inside each key never a writer beside anyone, readers
//! together, every token distinct.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::Fencer;

/// 24 clients on 6 keys (`{prefix}:rw-{k}`), three readers to a writer,
/// four rounds each, client `c` on sidecar `c % n`; panics on a writer
/// beside anyone, a token issued twice, or readers that never shared a
/// key.
pub async fn readers_and_writers_never_overlap(sidecars: &[Arc<Fencer>], prefix: &'static str) {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::Mutex;

    let readers: Arc<Vec<AtomicI64>> = Arc::new((0..6).map(|_| AtomicI64::new(0)).collect());
    let writers: Arc<Vec<AtomicI64>> = Arc::new((0..6).map(|_| AtomicI64::new(0)).collect());
    let most_readers = Arc::new(AtomicI64::new(0));
    let tokens: Arc<Mutex<HashMap<usize, Vec<u64>>>> = Arc::default();
    let clients: Vec<_> = (0..24usize)
        .map(|c| {
            let s = sidecars[c % sidecars.len()].clone();
            let (readers, writers) = (readers.clone(), writers.clone());
            let (tokens, most_readers) = (tokens.clone(), most_readers.clone());
            tokio::spawn(async move {
                let k = c % 6;
                let read = c % 4 != 0;
                let key = format!("{prefix}:rw-{k}");
                let mode = if read { "read" } else { "write" };
                for _ in 0..4 {
                    let r = s
                        .post(
                            &Fencer::path(&key, "acquire"),
                            json!({"mode": mode, "ttl_ms": 10_000, "wait_ms": 20_000}),
                        )
                        .await;
                    assert_eq!(r.status, 200, "{key} {mode}: {}", r.body);
                    if read {
                        let n = readers[k].fetch_add(1, Ordering::SeqCst) + 1;
                        most_readers.fetch_max(n, Ordering::SeqCst);
                        assert_eq!(
                            writers[k].load(Ordering::SeqCst),
                            0,
                            "{key}: a reader beside a writer"
                        );
                    } else {
                        assert_eq!(
                            writers[k].fetch_add(1, Ordering::SeqCst),
                            0,
                            "{key}: two writers"
                        );
                        assert_eq!(
                            readers[k].load(Ordering::SeqCst),
                            0,
                            "{key}: a writer beside readers"
                        );
                    }
                    tokens.lock().unwrap().entry(k).or_default().push(r.token());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if read {
                        readers[k].fetch_sub(1, Ordering::SeqCst);
                    } else {
                        writers[k].fetch_sub(1, Ordering::SeqCst);
                    }
                    let gone = s
                        .post(
                            &Fencer::path(&key, "release"),
                            json!({"lease_id": r.lease()}),
                        )
                        .await;
                    assert_eq!(gone.status, 200, "{key}: {}", gone.body);
                }
            })
        })
        .collect();
    for c in clients {
        c.await.unwrap();
    }
    for (k, seen) in tokens.lock().unwrap().iter() {
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            seen.len(),
            "{prefix}:rw-{k}: a token issued twice"
        );
    }
    assert!(
        most_readers.load(Ordering::SeqCst) >= 2,
        "readers never shared a key"
    );
}
