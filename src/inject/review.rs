//! AdmissionReview v1 in and out: which requests the injector looks at and
//! how each decision is answered to the API server.

use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};

use super::mutate::{mutate, Outcome};
use super::settings::InjectSettings;
use super::InjectError;

pub const API_VERSION: &str = "admission.k8s.io/v1";
/// Kubernetes keeps admission warnings of up to 256 characters whole.
const MAX_WARNING: usize = 256;

fn truncate(mut s: String, max: usize) -> String {
    if s.chars().count() > max {
        s = s.chars().take(max - 1).collect::<String>() + "…";
    }
    s
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<Request>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    uid: String,
    #[serde(default)]
    kind: GroupVersionKind,
    #[serde(default)]
    operation: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    object: Value,
}

#[derive(Debug, Default, Deserialize)]
struct GroupVersionKind {
    #[serde(default)]
    group: String,
    #[serde(default)]
    kind: String,
}

/// How a review ended, for the metric and the log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Result {
    Injected,
    NotRequested,
    AlreadyInjected,
    /// Not a pod CREATE (a misconfigured webhook rule): admitted unchanged.
    Ignored,
    /// The pod asked for injection and could not get it; admitted unchanged.
    FailedOpen,
    /// The same, with `fail_closed`: the pod was refused.
    Refused,
}

impl Result {
    pub fn as_str(self) -> &'static str {
        match self {
            Result::Injected => "injected",
            Result::NotRequested => "not_requested",
            Result::AlreadyInjected => "already_injected",
            Result::Ignored => "ignored",
            Result::FailedOpen => "failed_open",
            Result::Refused => "refused",
        }
    }
}

/// The answer to one review, and what to log about it.
pub struct Answer {
    pub body: Value,
    pub result: Result,
    pub namespace: String,
    pub pod: String,
    pub error: Option<InjectError>,
}

/// Answers one AdmissionReview body. `Err` is for a body that is not an
/// AdmissionReview v1 request at all (answered 400; the API server then
/// applies the webhook's failurePolicy).
pub fn answer(body: &[u8], settings: &InjectSettings) -> std::result::Result<Answer, InjectError> {
    let review: Review = serde_json::from_slice(body)
        .map_err(|e| InjectError::BadReview(format!("not an AdmissionReview: {e}")))?;
    if review.api_version != API_VERSION || review.kind != "AdmissionReview" {
        return Err(InjectError::BadReview(format!(
            "expected {API_VERSION} AdmissionReview, got {} {}",
            review.api_version, review.kind
        )));
    }
    let request = review
        .request
        .ok_or_else(|| InjectError::BadReview("no request".into()))?;
    if request.uid.is_empty() {
        return Err(InjectError::BadReview("request.uid is empty".into()));
    }
    let pod_name = request
        .object
        .pointer("/metadata/name")
        .or_else(|| request.object.pointer("/metadata/generateName"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let mut response = json!({"uid": request.uid, "allowed": true});
    let is_pod_create = request.kind.group.is_empty()
        && request.kind.kind == "Pod"
        && request.operation == "CREATE";
    let (result, error) = if !is_pod_create {
        (Result::Ignored, None)
    } else {
        match mutate(&request.object, settings) {
            Ok(Outcome::NotRequested) => (Result::NotRequested, None),
            Ok(Outcome::AlreadyInjected) => (Result::AlreadyInjected, None),
            Ok(Outcome::Patch(patch)) => {
                let patch = serde_json::to_vec(&patch).expect("a patch serializes");
                response["patchType"] = json!("JSONPatch");
                response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
                (Result::Injected, None)
            }
            Err(e) if settings.fail_closed => {
                response["allowed"] = json!(false);
                response["status"] = json!({
                    "code": 400,
                    "reason": "BadRequest",
                    "message": format!("fencer injector: {e}"),
                });
                (Result::Refused, Some(e))
            }
            Err(e) => {
                // Shown by kubectl to whoever applied the pod. The API
                // server may cut warnings above 256 characters; cut it here
                // at a character boundary instead (the log has it whole).
                let warning = format!("fencer sidecar NOT injected: {e}");
                response["warnings"] = json!([truncate(warning, MAX_WARNING)]);
                (Result::FailedOpen, Some(e))
            }
        }
    };
    Ok(Answer {
        body: json!({"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}),
        result,
        namespace: request.namespace,
        pod: pod_name,
        error,
    })
}
