//! One table of fence-store cases, asked of a real store and of the rule
//! itself ([`decide`]): the SQL stores' admission functions must decide
//! every case as the memory store does.

use std::time::Duration;

use fencer::gateway::fence_store::{decide, Decision, FenceStore, Mark, Mode, Presented};

fn soon(ms: u64) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_millis(ms)
}

/// Every case of [`decide`], both modes, asked of `store` against marks set
/// up by admitting a write token 5 (lease `a`, sequence `seq0`) and, where
/// `read0`, a reader's token 8 after it: the store decides as `decide`
/// does and moves the marks only when it should.
pub async fn check_rule_table(store: &dyn FenceStore) {
    let mut n = 0;
    for read0 in [false, true] {
        for seq0 in [None, Some(2u64)] {
            for mode in [Mode::Write, Mode::Read] {
                for token in [4u64, 5, 6, 8, 9] {
                    for lease in ["a", "b"] {
                        for seq in [None, Some(1u64), Some(2), Some(3)] {
                            n += 1;
                            let key = format!("case-{n}");
                            let first = store
                                .admit(
                                    &key,
                                    Presented::new(5, "a", seq0, Mode::Write),
                                    None,
                                    soon(2_000),
                                )
                                .await
                                .unwrap();
                            assert_eq!(
                                (first.decision, first.previous),
                                (Decision::Advanced, None)
                            );
                            if read0 {
                                let r = store
                                    .admit(
                                        &key,
                                        Presented::new(8, "r", None, Mode::Read),
                                        None,
                                        soon(2_000),
                                    )
                                    .await
                                    .unwrap();
                                assert_eq!(r.decision, Decision::Advanced);
                            }
                            let mark = Mark {
                                token: 5,
                                lease: "a",
                                seq: seq0.unwrap_or(0),
                                read_token: if read0 { 8 } else { 0 },
                            };
                            let want = decide(Some(mark), token, lease, seq, mode);
                            let got = store
                                .admit(
                                    &key,
                                    Presented::new(token, lease, seq, mode),
                                    None,
                                    soon(2_000),
                                )
                                .await
                                .unwrap();
                            let case = format!(
                                "marks 5/a/{seq0:?} read {read0}, asked {mode:?} {token}/{lease}/{seq:?}"
                            );
                            assert_eq!(got.decision, want, "{case}");
                            assert_eq!(got.previous, Some(mark.highest()), "{case}");
                            let (high, tag) = store.highest(&key).await.unwrap().unwrap();
                            if want.writes_mark(seq) && mode == Mode::Write {
                                assert_eq!((high, tag.as_str()), (token, lease), "{case}");
                            } else {
                                assert_eq!((high, tag.as_str()), (5, "a"), "{case}");
                            }
                            // The read mark: a writer above a reader it did
                            // not move is still held to it.
                            if want.accepted() {
                                let probe = store
                                    .admit(
                                        &key,
                                        Presented::new(7, "z", None, Mode::Write),
                                        None,
                                        soon(2_000),
                                    )
                                    .await
                                    .unwrap();
                                let read_mark = match (mode, &want) {
                                    (Mode::Read, Decision::Advanced) => token,
                                    _ => mark.read_token,
                                };
                                let write_mark = if mode == Mode::Write { token } else { 5 };
                                let expect = if 7 > read_mark && 7 > write_mark {
                                    Decision::Advanced
                                } else {
                                    Decision::Stale {
                                        highest: read_mark.max(write_mark),
                                    }
                                };
                                assert_eq!(probe.decision, expect, "{case}: then a writer's 7");
                            }
                        }
                    }
                }
            }
        }
    }
    // A key only readers have seen: no write mark, and a writer must
    // still come after them.
    let r = store
        .admit(
            "readers-only",
            Presented::new(8, "r", None, Mode::Read),
            None,
            soon(2_000),
        )
        .await
        .unwrap();
    assert_eq!((r.decision, r.previous), (Decision::Advanced, None));
    assert_eq!(store.highest("readers-only").await.unwrap(), None);
    let again = store
        .admit(
            "readers-only",
            Presented::new(6, "r2", None, Mode::Read),
            None,
            soon(2_000),
        )
        .await
        .unwrap();
    assert_eq!(again.decision, Decision::Shared);
    let late = store
        .admit(
            "readers-only",
            Presented::new(7, "w", None, Mode::Write),
            None,
            soon(2_000),
        )
        .await
        .unwrap();
    assert_eq!(late.decision, Decision::Stale { highest: 8 });
    let next = store
        .admit(
            "readers-only",
            Presented::new(9, "w", Some(1), Mode::Write),
            None,
            soon(2_000),
        )
        .await
        .unwrap();
    assert_eq!(next.decision, Decision::Advanced);
}
