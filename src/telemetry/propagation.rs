//! W3C trace context (`traceparent`, `tracestate`) in and out of fencer's
//! HTTP hops.
//!
//! In: a request's context becomes the parent of its span — if it has
//! exactly one well-formed `traceparent`. Two of them are not guessed
//! between (as with `Fencing-*` headers, the first is not silently
//! preferred to the last): the request is traced as a new trace, and the
//! forward carries only fencer's own header. Unlike a doubled
//! `Fencing-*` header it is not refused: a trace header decides nothing.
//!
//! Out: the forwarded request's `traceparent`/`tracestate` are *replaced*
//! by the current span's context, so the next hop sees fencer's span as its
//! parent and never two `traceparent` headers. With tracing off nothing is
//! read, written or removed: headers pass as they always did.

use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// The remote parent named by `headers`, if any (see the module doc).
pub fn extract(headers: &HeaderMap) -> Option<Context> {
    let mut parents = headers.get_all(TRACEPARENT).iter();
    let traceparent = parents.next()?.to_str().ok()?;
    if parents.next().is_some() {
        return None;
    }
    // Several `tracestate` headers are one list (W3C trace context §3.3.1).
    let tracestate = headers
        .get_all(TRACESTATE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    let cx = TraceContextPropagator::new().extract(&Incoming {
        traceparent,
        tracestate: (!tracestate.is_empty()).then_some(tracestate.as_str()),
    });
    cx.span().span_context().is_valid().then_some(cx)
}

/// Replaces the trace headers of an outgoing request with the current
/// span's context. Does nothing while tracing is off, or outside a span.
pub fn inject(headers: &mut HeaderMap) {
    if !super::tracing_enabled() {
        return;
    }
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return;
    }
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    TraceContextPropagator::new().inject_context(&cx, &mut Outgoing(headers));
}

struct Incoming<'a> {
    traceparent: &'a str,
    tracestate: Option<&'a str>,
}

impl Extractor for Incoming<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => Some(self.traceparent),
            TRACESTATE => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

struct Outgoing<'a>(&'a mut HeaderMap);

impl Injector for Outgoing<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn one_traceparent_is_a_parent_two_are_none() {
        let mut h = HeaderMap::new();
        assert!(extract(&h).is_none());
        h.append(TRACEPARENT, HeaderValue::from_static(TP));
        h.append(TRACESTATE, HeaderValue::from_static("a=1"));
        h.append(TRACESTATE, HeaderValue::from_static("b=2"));
        let cx = extract(&h).expect("a parent");
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_state().header(), "a=1,b=2");
        h.append(
            TRACEPARENT,
            HeaderValue::from_static("00-11111111111111111111111111111111-2222222222222222-01"),
        );
        assert!(extract(&h).is_none(), "two traceparents: no parent");
        let mut bad = HeaderMap::new();
        bad.insert(TRACEPARENT, HeaderValue::from_static("00-zz-00-01"));
        assert!(extract(&bad).is_none());
    }
}
