//! What the injector does to a pod: the pure part, no I/O, so every case
//! is a unit test and the webhook server stays a thin shell.
//!
//! The pod is changed as a JSON value and the JSON Patch the API server
//! wants is the difference between the two (`json_patch::diff`): index
//! shifts (the sidecar goes first among the init containers) are then the
//! diff's problem, not hand-written op paths that break on the next edit.

use std::collections::HashSet;

use serde_json::{json, Map, Value};

use super::annotations::{self, PodOptions};
use super::settings::InjectSettings;
use super::InjectError;

/// The injected container's name.
pub const SIDECAR_NAME: &str = "fencer";
/// Label the PodMonitor selects injected pods by.
pub const SIDECAR_LABEL: &str = "fencer.dev/sidecar";
/// The sidecar's admin port name (≤ 15 characters, unique in the pod).
pub const ADMIN_PORT_NAME: &str = "fencer-metrics";
const CONFIG_PATH: &str = "/etc/fencer/fencer.toml";
const SIGNING_DIR: &str = "/etc/fencer/signing";
/// The sidecar's `state_dir` (an `emptyDir`).
const STATE_DIR: &str = "/var/lib/fencer";

/// What the injector decided for one pod.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// No `fencer.dev/inject: "true"`: admitted unchanged.
    NotRequested,
    /// Injected before (reinvocation, re-applied manifest): unchanged.
    AlreadyInjected,
    /// The JSON Patch (RFC 6902) that adds the sidecar.
    Patch(json_patch::Patch),
}

/// Decides what to do with `pod` (the AdmissionReview's `request.object`).
pub fn mutate(pod: &Value, settings: &InjectSettings) -> Result<Outcome, InjectError> {
    let empty = Map::new();
    let annotations = pod
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    if !annotations::requested(annotations)? {
        return Ok(Outcome::NotRequested);
    }
    if annotations.get(annotations::STATUS).and_then(Value::as_str) == Some("injected") {
        return Ok(Outcome::AlreadyInjected);
    }
    let options = annotations::read(annotations, settings)?;
    let spec = pod
        .get("spec")
        .and_then(Value::as_object)
        .ok_or_else(|| InjectError::Malformed("the pod has no spec".into()))?;
    check_pod(spec, &options)?;

    let mut patched = pod.clone();
    let spec = patched
        .get_mut("spec")
        .and_then(Value::as_object_mut)
        .expect("checked above");
    let names = VolumeNames::choose(spec, options.socket.is_some());
    // Containers of the app first: they get the lock API's address (and the
    // socket directory) before the sidecar joins the list.
    for list in ["initContainers", "containers"] {
        if let Some(Value::Array(containers)) = spec.get_mut(list) {
            for c in containers {
                wire_app_container(c, &options, &names);
            }
        }
    }
    let volumes = array_at(spec, "volumes");
    volumes.push(json!({"name": names.config, "configMap": {"name": options.config_map}}));
    volumes.push(json!({"name": names.signing, "secret": {"secretName": settings.signing_secret}}));
    if let Some(socket_volume) = &names.socket {
        volumes.push(json!({"name": socket_volume, "emptyDir": {}}));
    }
    // One small file (the write-sequence reservation).
    volumes.push(json!({"name": names.state, "emptyDir": {"sizeLimit": "1Mi"}}));
    // First among the init containers: init containers after it may take
    // locks, and a native sidecar is started (and its startup probe
    // awaited) before the next init container runs.
    array_at(spec, "initContainers").insert(0, sidecar(settings, &options, &names));

    let metadata = patched
        .as_object_mut()
        .expect("a pod is an object")
        .entry("metadata")
        .or_insert_with(|| json!({}));
    let metadata = metadata
        .as_object_mut()
        .ok_or_else(|| InjectError::Malformed("metadata is not an object".into()))?;
    object_at(metadata, "annotations").insert(annotations::STATUS.into(), json!("injected"));
    object_at(metadata, "labels").insert(SIDECAR_LABEL.into(), json!("true"));
    Ok(Outcome::Patch(json_patch::diff(pod, &patched)))
}

/// Refusals that would otherwise give a pod that never starts.
fn check_pod(spec: &Map<String, Value>, options: &PodOptions) -> Result<(), InjectError> {
    if spec.get("hostNetwork").and_then(Value::as_bool) == Some(true) {
        // Loopback would be the node's: every host-network pod on the node
        // could use this pod's leases, and two such pods clash on ports.
        return Err(InjectError::Unsupported(
            "hostNetwork pods are not injected (the lock API's loopback would be the node's)"
                .into(),
        ));
    }
    let ours = [
        options.lock_api_port,
        options.proxy_port,
        options.admin_port,
    ];
    for list in ["initContainers", "containers"] {
        for c in containers(spec, list) {
            let name = c.get("name").and_then(Value::as_str).unwrap_or("?");
            if name == SIDECAR_NAME {
                return Err(InjectError::Clash(format!(
                    "the pod already has a container named `{SIDECAR_NAME}`"
                )));
            }
            for p in c
                .get("ports")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let port = p.get("containerPort").and_then(Value::as_u64);
                if port.is_some_and(|p| ours.iter().any(|&o| u64::from(o) == p)) {
                    return Err(InjectError::Clash(format!(
                        "container `{name}` uses port {} which the sidecar needs (set fencer.dev/lock-api-port, proxy-port or admin-port)",
                        port.unwrap_or_default()
                    )));
                }
                if p.get("name").and_then(Value::as_str) == Some(ADMIN_PORT_NAME) {
                    return Err(InjectError::Clash(format!(
                        "container `{name}` has a port named `{ADMIN_PORT_NAME}`"
                    )));
                }
            }
            if let Some(socket) = &options.socket {
                let dir = socket_dir(socket);
                let clash = c
                    .get("volumeMounts")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .any(|m| m.get("mountPath").and_then(Value::as_str) == Some(dir));
                if clash {
                    return Err(InjectError::Clash(format!(
                        "container `{name}` already mounts something at {dir}, the lock API socket's directory"
                    )));
                }
            }
        }
    }
    if options.socket.is_some()
        && spec
            .get("securityContext")
            .and_then(|s| s.get("fsGroup"))
            .is_none()
    {
        // The socket is mode 0660: the app reaches it through the group the
        // shared emptyDir gets from fsGroup. Without it, connect() fails.
        return Err(InjectError::Unsupported(
            "fencer.dev/lock-api-socket needs spec.securityContext.fsGroup (the socket is group-accessible only)".into(),
        ));
    }
    Ok(())
}

/// Volume names that clash with none the pod has.
struct VolumeNames {
    config: String,
    signing: String,
    socket: Option<String>,
    /// The sidecar's `state_dir`: survives a restart of the sidecar
    /// container (not of the pod), which is when leases are adopted.
    state: String,
}

impl VolumeNames {
    fn choose(spec: &Map<String, Value>, socket: bool) -> VolumeNames {
        let taken: HashSet<&str> = spec
            .get("volumes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|v| v.get("name").and_then(Value::as_str))
            .collect();
        let free = |base: &str| -> String {
            std::iter::once(base.to_owned())
                .chain((2..).map(|n| format!("{base}-{n}")))
                .find(|n| !taken.contains(n.as_str()))
                .expect("an unbounded sequence has a free name")
        };
        VolumeNames {
            config: free("fencer-config"),
            signing: free("fencer-signing"),
            socket: socket.then(|| free("fencer-socket")),
            state: free("fencer-state"),
        }
    }
}

fn sidecar(settings: &InjectSettings, o: &PodOptions, names: &VolumeNames) -> Value {
    let mut vars = vec![
        env(
            "FENCER__SIDECAR__LISTEN",
            format!("127.0.0.1:{}", o.lock_api_port),
        ),
        env(
            "FENCER__PROXY__LISTEN",
            format!("127.0.0.1:{}", o.proxy_port),
        ),
        env("FENCER__ADMIN__LISTEN", format!("0.0.0.0:{}", o.admin_port)),
        env("FENCER__SIGNING__KEY_ID", settings.signing_key_id.clone()),
        env(
            "FENCER__SIGNING__SECRET_FILE",
            format!("{SIGNING_DIR}/{}", settings.signing_key_id),
        ),
    ];
    if !settings.gateway_url.is_empty() {
        let base = settings.gateway_url.trim_end_matches('/');
        vars.push(env_var("FENCER__PROXY__UPSTREAM", base));
        vars.push(env(
            "FENCER__SIDECAR__PREREGISTER_URL",
            format!("{base}/_fencer/v1/fences/"),
        ));
    }
    let mut mounts = vec![
        json!({"name": names.config, "mountPath": CONFIG_PATH, "subPath": "fencer.toml", "readOnly": true}),
        json!({"name": names.signing, "mountPath": SIGNING_DIR, "readOnly": true}),
        json!({"name": names.state, "mountPath": STATE_DIR}),
    ];
    vars.push(env("FENCER__SIDECAR__STATE_DIR", STATE_DIR.to_owned()));
    if let (Some(socket), Some(volume)) = (&o.socket, &names.socket) {
        vars.push(env_var("FENCER__SIDECAR__LISTEN_UNIX", socket));
        mounts.push(json!({"name": volume, "mountPath": socket_dir(socket)}));
    }
    let probe = |path: &str, period: u32| json!({"httpGet": {"path": path, "port": o.admin_port}, "periodSeconds": period});
    let mut startup = probe("/readyz", 1);
    startup["failureThreshold"] = json!(60);
    let mut c = json!({
        "name": SIDECAR_NAME,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        // A native sidecar (Kubernetes 1.29+): started before the app,
        // stopped after it, so leases are released on the way down.
        "restartPolicy": "Always",
        "args": ["--config", CONFIG_PATH, "sidecar"],
        "env": vars,
        "ports": [{"name": ADMIN_PORT_NAME, "containerPort": o.admin_port}],
        "startupProbe": startup,
        "readinessProbe": probe("/readyz", 5),
        "livenessProbe": probe("/healthz", 10),
        "resources": {
            "requests": {"cpu": o.cpu_request, "memory": o.memory_request},
            "limits": {"cpu": o.cpu_limit, "memory": o.memory_limit},
        },
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": true,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": mounts,
    });
    if !settings.env_secret.is_empty() {
        c["envFrom"] = json!([{"secretRef": {"name": settings.env_secret}}]);
    }
    c
}

/// Tells an app container where the lock API and the proxy are; a variable
/// the container already sets is left alone (its owner's value wins).
fn wire_app_container(c: &mut Value, o: &PodOptions, names: &VolumeNames) {
    let Some(c) = c.as_object_mut() else { return };
    let mut wanted = vec![
        env(
            "FENCER_API",
            format!("http://127.0.0.1:{}", o.lock_api_port),
        ),
        env("FENCER_PROXY", format!("http://127.0.0.1:{}", o.proxy_port)),
    ];
    if let Some(socket) = &o.socket {
        wanted.push(env_var("FENCER_API_SOCKET", socket));
    }
    let list = array_at(c, "env");
    for var in wanted {
        let exists = list.iter().any(|e| e.get("name") == var.get("name"));
        if !exists {
            list.push(var);
        }
    }
    if let (Some(socket), Some(volume)) = (&o.socket, &names.socket) {
        array_at(c, "volumeMounts").push(json!({"name": volume, "mountPath": socket_dir(socket)}));
    }
}

fn socket_dir(socket: &str) -> &str {
    socket.rsplit_once('/').map_or("/", |(dir, _)| dir)
}

fn env(name: &str, value: String) -> Value {
    json!({"name": name, "value": value})
}

fn env_var(name: &str, value: &str) -> Value {
    json!({"name": name, "value": value})
}

fn containers<'a>(spec: &'a Map<String, Value>, list: &str) -> impl Iterator<Item = &'a Value> {
    spec.get(list)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// The array at `key`, created if absent (or if it was `null`).
fn array_at<'a>(obj: &'a mut Map<String, Value>, key: &str) -> &'a mut Vec<Value> {
    let slot = obj.entry(key).or_insert_with(|| json!([]));
    if !slot.is_array() {
        *slot = json!([]);
    }
    slot.as_array_mut().expect("made an array above")
}

/// The object at `key`, created if absent (or if it was `null`).
fn object_at<'a>(obj: &'a mut Map<String, Value>, key: &str) -> &'a mut Map<String, Value> {
    let slot = obj.entry(key).or_insert_with(|| json!({}));
    if !slot.is_object() {
        *slot = json!({});
    }
    slot.as_object_mut().expect("made an object above")
}
