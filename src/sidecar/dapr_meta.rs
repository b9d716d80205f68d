//! What fencer tells Dapr's SDKs about itself (`GET /v1.0/metadata`, gRPC
//! `GetMetadata`): their start-up check reads it. One source for both
//! protocols: the configured lock stores as `lock.<backend>` components.

use std::collections::BTreeMap;

use super::api_state::ApiState;

/// Dapr's app id; fencer serves no app of its own.
pub const APP_ID: &str = "fencer";

/// Dapr's `RegisteredComponents` for one lock store.
pub struct Component {
    pub name: String,
    /// `lock.<backend>`, e.g. `lock.redis`.
    pub kind: String,
    pub version: &'static str,
}

/// Every configured Dapr lock store, on this sidecar's backend.
pub fn components(state: &ApiState) -> Vec<Component> {
    let backend = state.locks.backend().name();
    state
        .dapr_stores
        .iter()
        .map(|s| Component {
            name: s.name.clone(),
            kind: format!("lock.{backend}"),
            version: "v1",
        })
        .collect()
}

/// fencer's version where Dapr puts its runtime's.
pub fn runtime_version() -> String {
    format!("fencer-{}", env!("CARGO_PKG_VERSION"))
}

/// Dapr's free-form `extended` map: which runtime answers.
pub fn extended(state: &ApiState) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("runtime".to_owned(), "fencer".to_owned()),
        (
            "backend".to_owned(),
            state.locks.backend().name().to_owned(),
        ),
    ])
}
