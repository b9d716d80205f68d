//! Reading an AdmissionReview body, bounded in size, in time, and in what
//! all requests hold at once.
//!
//! The webhook port takes bodies of up to [`MAX_REVIEW_BYTES`] from
//! whoever can reach it. Without a time bound and a shared budget, 40
//! clients that stalled halfway through 4 MiB bodies took an injector to
//! 202 MiB, over its chart's 128 Mi limit — and an OOM-killed injector
//! means pods start without their sidecar (issue 27). So:
//!
//! - the whole body must arrive within `inject.body_timeout_ms`;
//! - every byte held for a review is first reserved from one byte
//!   [`Budget`] (`inject.max_buffered_bytes`): the body as it arrives (all
//!   of a declared `Content-Length` at once; a chunked body frame by
//!   frame, and once more while it is joined), then the parsed form of it,
//!   estimated from its count of JSON values ([`parse_cost`]) — a 4 MiB
//!   array of zeros parses into 2 million 32-byte values, 16 times its
//!   size. A review that does not fit is refused at once (503), never
//!   queued, so nothing waits on memory held by a stalled client.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// An AdmissionReview carries one object; etcd stores at most 1.5 MiB per
/// object, and the review may carry it twice (object, oldObject).
pub const MAX_REVIEW_BYTES: usize = 4 * 1024 * 1024;
/// JSON values in one review at most. A pod spec has hundreds to a few
/// thousand; the bound keeps the parsed form of a hostile body (an array
/// of zeros) to what [`VALUE_COST`] accounts for.
pub const MAX_JSON_VALUES: usize = 50_000;
/// A body declared larger than [`MAX_REVIEW_BYTES`] but at most this is
/// read and thrown away before the 413, so the client can read it; a
/// larger one is refused at once.
pub const MAX_DRAINED_BYTES: usize = 4 * MAX_REVIEW_BYTES;
/// Bytes reserved per JSON value for the review's parsed form: a 32-byte
/// `serde_json::Value`, its map entry and key, the patched copy of the pod
/// and the JSON patch between them, with the allocator's rounding.
pub const VALUE_COST: usize = 256;
/// The budget one review can need at most: it must fit in
/// `inject.max_buffered_bytes`, or the largest reviews could never pass.
pub const MAX_REVIEW_COST: usize = MAX_REVIEW_BYTES + MAX_JSON_VALUES * VALUE_COST;

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("an AdmissionReview is at most {MAX_REVIEW_BYTES} bytes")]
    TooLarge,
    #[error("an AdmissionReview has at most {MAX_JSON_VALUES} JSON values")]
    TooComplex,
    #[error("the injector holds as many review bytes as it may ({0} bytes); try again")]
    OverBudget(usize),
    #[error("the body did not arrive within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Unreadable(String),
}

/// The bytes all reviews in flight may hold together.
#[derive(Clone)]
pub struct Budget {
    bytes: Arc<Semaphore>,
    total: usize,
}

impl Budget {
    pub fn new(total: usize) -> Budget {
        Budget {
            bytes: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// Bytes reserved right now.
    pub fn in_use(&self) -> usize {
        self.total - self.bytes.available_permits()
    }

    fn reserve(&self, held: &mut Held, bytes: usize) -> Result<(), BodyError> {
        if bytes == 0 {
            return Ok(());
        }
        let n = u32::try_from(bytes).map_err(|_| BodyError::OverBudget(self.total))?;
        let permit = self
            .bytes
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| BodyError::OverBudget(self.total))?;
        match &mut held.0 {
            Some(p) => p.merge(permit),
            None => held.0 = Some(permit),
        }
        crate::metrics::INJECT.buffered_bytes.add(bytes as i64);
        Ok(())
    }
}

/// Bytes one review holds from the [`Budget`]; given back when dropped.
#[derive(Default)]
pub struct Held(Option<OwnedSemaphorePermit>);

impl Held {
    /// Gives `bytes` back to the budget (no longer held).
    fn release(&mut self, bytes: usize) {
        if let Some(part) = self.0.as_mut().and_then(|p| p.split(bytes)) {
            crate::metrics::INJECT
                .buffered_bytes
                .sub(part.num_permits() as i64);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            crate::metrics::INJECT
                .buffered_bytes
                .sub(p.num_permits() as i64);
        }
    }
}

/// Reads a review's body (`declared`: its `Content-Length`) within
/// `timeout`, and reserves its parsed form too: what it returns holds its
/// budget until dropped, which must be after the answer is built.
pub async fn read(
    body: Body,
    declared: Option<u64>,
    budget: &Budget,
    timeout: Duration,
) -> Result<(Bytes, Held), BodyError> {
    let declared = match declared {
        Some(n) if n > MAX_REVIEW_BYTES as u64 => {
            if n <= MAX_DRAINED_BYTES as u64 {
                let _ = tokio::time::timeout(timeout, drain(body)).await;
            }
            return Err(BodyError::TooLarge);
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    let mut held = Held::default();
    let bytes = tokio::time::timeout(timeout, collect(body, declared, budget, &mut held))
        .await
        .map_err(|_| BodyError::Timeout(timeout))??;
    let values = count_values(&bytes)?;
    budget.reserve(&mut held, parse_cost(values))?;
    Ok((bytes, held))
}

/// Reads a body that will be refused and drops its bytes as they come
/// (nothing is held). Answering before the client has sent it all would
/// close the connection under a client still writing: it then sees a
/// broken pipe or a reset instead of the 413, and the kernel may discard
/// the answer. Bounded by [`MAX_DRAINED_BYTES`] and the body timeout.
async fn drain(mut body: Body) {
    while let Some(Ok(_)) = body.frame().await {}
}

/// The bytes reserved for the parsed form of a body of `values` JSON
/// values.
pub fn parse_cost(values: usize) -> usize {
    values * VALUE_COST
}

async fn collect(
    mut body: Body,
    declared: Option<usize>,
    budget: &Budget,
    held: &mut Held,
) -> Result<Bytes, BodyError> {
    // With a declared length: one exact allocation, reserved before a
    // byte is read. Without one: the frames as they come (no copy, no
    // growth by doubling), joined once at the end.
    let mut buf = Vec::new();
    let mut frames = Vec::new();
    let mut len = 0;
    if let Some(n) = declared {
        budget.reserve(held, n)?;
        buf.reserve_exact(n);
    }
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyError::Unreadable(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        len += data.len();
        if len > declared.unwrap_or(MAX_REVIEW_BYTES) {
            return Err(BodyError::TooLarge);
        }
        if declared.is_some() {
            buf.extend_from_slice(&data);
        } else {
            budget.reserve(held, data.len())?;
            frames.push(data);
        }
    }
    if declared.is_some() {
        return Ok(Bytes::from(buf));
    }
    if frames.len() <= 1 {
        return Ok(frames.pop().unwrap_or_default());
    }
    // The joined copy and the frames live at once, for a moment.
    budget.reserve(held, len)?;
    let mut joined = Vec::with_capacity(len);
    for f in frames.drain(..) {
        joined.extend_from_slice(&f);
    }
    drop(frames);
    held.release(len);
    Ok(Bytes::from(joined))
}

/// Counts the JSON values of `body` (keys included) without building
/// them; [`BodyError::TooComplex`] past [`MAX_JSON_VALUES`]. Malformed
/// JSON is left for the real parse to report.
fn count_values(body: &[u8]) -> Result<usize, BodyError> {
    let left = Cell::new(MAX_JSON_VALUES);
    let mut de = serde_json::Deserializer::from_slice(body);
    match (Count { left: &left }).deserialize(&mut de) {
        Ok(()) => Ok(MAX_JSON_VALUES - left.get()),
        Err(_) if left.get() == 0 => Err(BodyError::TooComplex),
        Err(_) => Ok(MAX_JSON_VALUES - left.get()),
    }
}

struct Count<'a> {
    left: &'a Cell<usize>,
}

impl Count<'_> {
    fn tick<E: serde::de::Error>(&self) -> Result<(), E> {
        match self.left.get() {
            0 => Err(E::custom("too many JSON values")),
            n => {
                self.left.set(n - 1);
                Ok(())
            }
        }
    }

    fn again(&self) -> Self {
        Count { left: self.left }
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        self.tick()
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        self.tick()
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        self.tick()
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        self.tick()
    }
    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
        self.tick()
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.tick()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.tick()?;
        while seq.next_element_seed(self.again())?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.tick()?;
        while map.next_key_seed(self.again())?.is_some() {
            map.next_value_seed(self.again())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_counted_keys_included_and_bounded() {
        // {} "a" [] 1 2 {} "b" null "c" "x"
        assert_eq!(
            count_values(br#"{"a":[1,2,{"b":null}],"c":"x"}"#).unwrap(),
            10
        );
        let zeros = format!("[{}0]", "0,".repeat(MAX_JSON_VALUES));
        assert!(matches!(
            count_values(zeros.as_bytes()),
            Err(BodyError::TooComplex)
        ));
        // Malformed: counted as far as it goes, the parse reports it.
        assert_eq!(count_values(b"[1,2,").unwrap(), 3);
    }

    #[tokio::test]
    async fn a_body_holds_its_bytes_and_parse_cost_until_dropped_and_what_does_not_fit_is_refused()
    {
        let body = br#"{"kind":"AdmissionReview"}"#;
        let budget = Budget::new(body.len() + parse_cost(3) + 10);
        let (bytes, held) = read(
            Body::from(&body[..]),
            Some(body.len() as u64),
            &budget,
            Duration::from_secs(1),
        )
        .await
        .unwrap();
        assert_eq!(&bytes[..], body);
        assert_eq!(budget.in_use(), body.len() + parse_cost(3));
        // A second declared body larger than what is left: refused at once.
        let err = read(Body::empty(), Some(11), &budget, Duration::from_secs(1)).await;
        assert!(matches!(err, Err(BodyError::OverBudget(_))));
        drop(held);
        assert_eq!(budget.in_use(), 0);
    }
}
