//! The per-pod `fencer.dev/*` annotations, read and checked.
//!
//! Every annotation under `fencer.dev/` must be one the injector knows: a
//! misspelt `fencer.dev/memory-limt` silently ignored would leave the pod
//! with a limit its owner believes is changed.

use serde_json::{Map, Value};

use super::quantity;
use super::settings::{is_dns_subdomain, InjectSettings};
use super::InjectError;

pub const PREFIX: &str = "fencer.dev/";
pub const INJECT: &str = "fencer.dev/inject";
/// Set by the injector on every pod it changed: a second review (webhook
/// reinvocation, a re-applied pod) finds it and changes nothing.
pub const STATUS: &str = "fencer.dev/status";
pub const CONFIG: &str = "fencer.dev/config";
pub const LOCK_API_PORT: &str = "fencer.dev/lock-api-port";
pub const LOCK_API_SOCKET: &str = "fencer.dev/lock-api-socket";
pub const PROXY_PORT: &str = "fencer.dev/proxy-port";
pub const ADMIN_PORT: &str = "fencer.dev/admin-port";
pub const CPU_REQUEST: &str = "fencer.dev/cpu-request";
pub const CPU_LIMIT: &str = "fencer.dev/cpu-limit";
pub const MEMORY_REQUEST: &str = "fencer.dev/memory-request";
pub const MEMORY_LIMIT: &str = "fencer.dev/memory-limit";

const KNOWN: [&str; 11] = [
    INJECT,
    STATUS,
    CONFIG,
    LOCK_API_PORT,
    LOCK_API_SOCKET,
    PROXY_PORT,
    ADMIN_PORT,
    CPU_REQUEST,
    CPU_LIMIT,
    MEMORY_REQUEST,
    MEMORY_LIMIT,
];

/// Longest Unix socket path Linux accepts (`sun_path` is 108 bytes with
/// its terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// What one pod asked for, with the injector's defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct PodOptions {
    pub config_map: String,
    pub lock_api_port: u16,
    pub proxy_port: u16,
    pub admin_port: u16,
    /// Absolute path of the lock API's Unix socket, if asked for.
    pub socket: Option<String>,
    pub cpu_request: String,
    pub cpu_limit: String,
    pub memory_request: String,
    pub memory_limit: String,
}

/// Whether the pod asks for injection: `Ok(false)` without the annotation
/// or with `"false"`; anything but `"true"`/`"false"` is an error.
pub fn requested(annotations: &Map<String, Value>) -> Result<bool, InjectError> {
    match annotations.get(INJECT) {
        None => Ok(false),
        Some(Value::String(s)) if s == "true" => Ok(true),
        Some(Value::String(s)) if s == "false" => Ok(false),
        Some(other) => Err(bad(
            INJECT,
            format!("must be \"true\" or \"false\", not {other}"),
        )),
    }
}

pub fn read(
    annotations: &Map<String, Value>,
    defaults: &InjectSettings,
) -> Result<PodOptions, InjectError> {
    for name in annotations.keys() {
        if name.starts_with(PREFIX) && !KNOWN.contains(&name.as_str()) {
            return Err(bad(
                name,
                format!("unknown annotation; known: {}", KNOWN.join(", ")),
            ));
        }
    }
    let text = |name: &str| -> Result<Option<String>, InjectError> {
        match annotations.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(bad(name, format!("must be a string, not {other}"))),
        }
    };
    let port = |name: &str, default: u16| -> Result<u16, InjectError> {
        match text(name)? {
            None => Ok(default),
            Some(s) => match s.parse::<u16>() {
                Ok(p) if p > 0 && s.bytes().all(|b| b.is_ascii_digit()) => Ok(p),
                _ => Err(bad(name, format!("`{s}` is not a port (1-65535)"))),
            },
        }
    };
    let config_map = text(CONFIG)?.unwrap_or_else(|| defaults.config_map.clone());
    if !is_dns_subdomain(&config_map) {
        return Err(bad(
            CONFIG,
            format!("`{config_map}` is not a ConfigMap name"),
        ));
    }
    let options = PodOptions {
        config_map,
        lock_api_port: port(LOCK_API_PORT, defaults.lock_api_port)?,
        proxy_port: port(PROXY_PORT, defaults.proxy_port)?,
        admin_port: port(ADMIN_PORT, defaults.admin_port)?,
        socket: text(LOCK_API_SOCKET)?.map(check_socket).transpose()?,
        cpu_request: text(CPU_REQUEST)?.unwrap_or_else(|| defaults.cpu_request.clone()),
        cpu_limit: text(CPU_LIMIT)?.unwrap_or_else(|| defaults.cpu_limit.clone()),
        memory_request: text(MEMORY_REQUEST)?.unwrap_or_else(|| defaults.memory_request.clone()),
        memory_limit: text(MEMORY_LIMIT)?.unwrap_or_else(|| defaults.memory_limit.clone()),
    };
    let ports = [
        options.lock_api_port,
        options.proxy_port,
        options.admin_port,
    ];
    if ports[0] == ports[1] || ports[0] == ports[2] || ports[1] == ports[2] {
        return Err(bad(
            ADMIN_PORT,
            format!("the lock API, proxy and admin ports must differ, got {ports:?}"),
        ));
    }
    for (name, q, memory) in [
        (CPU_REQUEST, &options.cpu_request, false),
        (CPU_LIMIT, &options.cpu_limit, false),
        (MEMORY_REQUEST, &options.memory_request, true),
        (MEMORY_LIMIT, &options.memory_limit, true),
    ] {
        quantity::parse(q, memory).map_err(|m| bad(name, m))?;
    }
    quantity::check_request_within_limit(&options.cpu_request, &options.cpu_limit, false)
        .map_err(|m| bad(CPU_REQUEST, m))?;
    quantity::check_request_within_limit(&options.memory_request, &options.memory_limit, true)
        .map_err(|m| bad(MEMORY_REQUEST, m))?;
    Ok(options)
}

/// A socket path must be absolute, short enough for `sun_path`, in a
/// directory of its own (the directory becomes a shared `emptyDir`), and
/// free of `..` and odd characters (it ends up in a mount path).
fn check_socket(path: String) -> Result<String, InjectError> {
    let ok_chars = path
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.'));
    let dir_ok = path
        .rsplit_once('/')
        .is_some_and(|(dir, file)| dir.len() > 1 && !file.is_empty());
    let segments_ok = path
        .split('/')
        .skip(1)
        .all(|s| !s.is_empty() && s != "." && s != "..");
    if !path.starts_with('/')
        || path.len() > MAX_SOCKET_PATH
        || !ok_chars
        || !dir_ok
        || !segments_ok
    {
        return Err(bad(
            LOCK_API_SOCKET,
            format!(
                "`{path}` must be an absolute path below a directory other than /, at most {MAX_SOCKET_PATH} bytes of [A-Za-z0-9/._-], without . or .. segments (e.g. /var/run/fencer/lock.sock)"
            ),
        ));
    }
    Ok(path)
}

fn bad(annotation: &str, message: String) -> InjectError {
    InjectError::BadAnnotation {
        annotation: annotation.to_owned(),
        message,
    }
}
