//! The command line of `fencer lock`: its flags, and the parsers that turn
//! durations and the API address into checked values, so that a bad value
//! is a usage error (exit 64) before anything is acquired.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::settings::limits::{MAX_TTL_MS, MAX_WAIT_MS, MIN_TTL_MS};

/// The longest `--grace` accepted: a stop that takes longer than an hour
/// is a hang, not a grace period.
const MAX_GRACE: Duration = Duration::from_secs(3600);

/// `fencer lock KEY [options] -- CMD [ARGS…]`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Exit codes: 64 usage, 69 sidecar unreachable or unexpected answer, \
                  70 lease lost while CMD ran, 75 key held (not acquired within --wait), \
                  126 CMD not executable, 127 CMD not found, else CMD's own status \
                  (128+N when a signal N ended it)."
)]
pub struct LockArgs {
    /// The lock key (1-512 bytes, no control characters).
    pub key: String,

    /// Lease time to live, renewed by the sidecar while CMD runs
    /// (`30s`, `500ms`, `2m`, `1h`; a plain number is milliseconds).
    /// Default: the sidecar's `sidecar.default_ttl_ms`.
    #[arg(long, value_parser = parse_ttl)]
    pub ttl: Option<Duration>,

    /// How long to wait for a held key; `0` fails at once (exit 75).
    /// Default: the sidecar's `sidecar.default_wait_ms` (0 unless configured).
    #[arg(long, value_parser = parse_wait)]
    pub wait: Option<Duration>,

    /// The sidecar's lock API: `http://host:port` or `unix:/path/to/socket`.
    #[arg(
        long,
        env = "FENCER_API",
        default_value = "http://127.0.0.1:7411",
        value_parser = ApiAddr::parse
    )]
    pub api: ApiAddr,

    /// After a lost lease, how long CMD has between SIGTERM and SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_grace)]
    pub grace: Duration,

    /// Owner recorded with the lease (shown by `GET /v1/locks`).
    /// Default: `fencer lock (pid N)`.
    #[arg(long)]
    pub owner: Option<String>,

    /// The command and its arguments, run directly (not through a shell).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// Where the sidecar's lock API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiAddr {
    /// `host:port` of an `http://` URL.
    Tcp(String),
    /// The path of a `unix:` socket (`sidecar.listen_unix`).
    Unix(PathBuf),
}

impl ApiAddr {
    /// `http://host[:port][/]` or `unix:/path`; TLS is not offered because
    /// the sidecar's API is local (loopback or a socket file).
    pub fn parse(raw: &str) -> Result<ApiAddr, String> {
        if let Some(path) = raw.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("`unix:` needs a socket path, e.g. unix:/run/fencer.sock".into());
            }
            return Ok(ApiAddr::Unix(PathBuf::from(path)));
        }
        let url = url::Url::parse(raw).map_err(|e| format!("`{raw}` is not a URL: {e}"))?;
        if url.scheme() != "http" {
            return Err(format!(
                "`{raw}`: only http:// and unix: are supported (the lock API is local)"
            ));
        }
        if !matches!(url.path(), "" | "/") || url.query().is_some() {
            return Err(format!("`{raw}`: give the API's base URL, without a path"));
        }
        let host = url
            .host_str()
            .ok_or_else(|| format!("`{raw}` has no host"))?;
        let port = url.port_or_known_default().unwrap_or(80);
        Ok(ApiAddr::Tcp(format!("{host}:{port}")))
    }
}

impl std::fmt::Display for ApiAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiAddr::Tcp(authority) => write!(f, "http://{authority}"),
            ApiAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// `500ms`, `30s`, `2m`, `1h`, or a plain number of milliseconds.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (digits, unit) = raw.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{raw}` is not a duration (e.g. 500ms, 30s, 2m, 1h)"))?;
    let per_unit: u64 = match unit {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => {
            return Err(format!(
                "`{raw}`: unknown unit `{unit}` (use ms, s, m or h)"
            ))
        }
    };
    n.checked_mul(per_unit)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("`{raw}` is too long"))
}

fn within(raw: &str, min: Duration, max: Duration) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d < min || d > max {
        return Err(format!(
            "`{raw}` is outside {}ms..={}ms",
            min.as_millis(),
            max.as_millis()
        ));
    }
    Ok(d)
}

/// The sidecar's own bounds, checked here so the error is a usage error.
fn parse_ttl(raw: &str) -> Result<Duration, String> {
    within(
        raw,
        Duration::from_millis(MIN_TTL_MS),
        Duration::from_millis(MAX_TTL_MS),
    )
}

fn parse_wait(raw: &str) -> Result<Duration, String> {
    within(raw, Duration::ZERO, Duration::from_millis(MAX_WAIT_MS))
}

fn parse_grace(raw: &str) -> Result<Duration, String> {
    within(raw, Duration::ZERO, MAX_GRACE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in [
            "",
            "s",
            "1.5s",
            "-1",
            "10 parsecs",
            "3d",
            "99999999999999999999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(parse_ttl("50ms").is_err());
        assert!(parse_ttl("2h").is_err());
        assert!(parse_wait("0").is_ok());
        assert!(parse_wait("6m").is_err());
    }

    #[test]
    fn api_addresses() {
        assert_eq!(
            ApiAddr::parse("http://127.0.0.1:7411"),
            Ok(ApiAddr::Tcp("127.0.0.1:7411".into()))
        );
        assert_eq!(
            ApiAddr::parse("http://localhost/"),
            Ok(ApiAddr::Tcp("localhost:80".into()))
        );
        assert_eq!(
            ApiAddr::parse("unix:/run/fencer.sock"),
            Ok(ApiAddr::Unix("/run/fencer.sock".into()))
        );
        for bad in [
            "https://x:1",
            "127.0.0.1:7411",
            "http://x:1/v1",
            "unix:",
            "ftp://x",
        ] {
            assert!(ApiAddr::parse(bad).is_err(), "{bad}");
        }
    }
}
