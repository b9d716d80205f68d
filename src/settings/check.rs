//! The small checks every section's validation uses, and the error they
//! return: each names the offending field, because an operator reading
//! `exit 2` in a crash-looping pod needs to know exactly which line to fix.

/// A configuration error: which field, and what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Load(String),
    #[error("invalid value for `{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

pub(crate) fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

/// A URL (or libpq `key=value` string) with its password replaced.
pub fn redact_url(raw: &str) -> String {
    const MASK: &str = "REDACTED";
    if let Ok(mut url) = url::Url::parse(raw) {
        if url.password().is_some() {
            let _ = url.set_password(Some(MASK));
        }
        if url
            .query_pairs()
            .any(|(k, _)| k.eq_ignore_ascii_case("password"))
        {
            let pairs: Vec<(String, String)> = url
                .query_pairs()
                .map(|(k, v)| {
                    let v = if k.eq_ignore_ascii_case("password") {
                        MASK.to_owned()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            url.query_pairs_mut().clear().extend_pairs(pairs);
        }
        return url.to_string();
    }
    static KV: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)").expect("valid regex")
    });
    KV.replace_all(raw, format!("${{1}}{MASK}")).into_owned()
}

/// Reads a secret from a file or an environment variable; `fields` name the
/// two settings for error messages.
pub(crate) fn read_secret(
    fields: (&'static str, &'static str),
    file: Option<&str>,
    env: Option<&str>,
) -> Result<Option<Vec<u8>>, ConfigError> {
    if let Some(path) = file {
        let data = std::fs::read(path)
            .map_err(|e| invalid(fields.0, format!("cannot read {path}: {e}")))?;
        return check_secret(fields.0, data.trim_ascii().to_vec())
            .map(Some)
            .map_err(|e| in_file(e, path));
    }
    if let Some(var) = env {
        let value = std::env::var(var)
            .map_err(|_| invalid(fields.1, format!("environment variable {var} is not set")))?;
        // Trimmed like a file: a Kubernetes secret mounted as a variable
        // often ends with a newline the other side does not have.
        return check_secret(fields.1, value.trim_ascii().as_bytes().to_vec()).map(Some);
    }
    Ok(None)
}

/// `e` with the file it concerns named first: "the secret is too short"
/// alone does not say which of several mounted secrets to fix.
fn in_file(e: ConfigError, path: &str) -> ConfigError {
    match e {
        ConfigError::Invalid { field, message } => invalid(field, format!("{path}: {message}")),
        other => other,
    }
}

pub(crate) fn check_range(
    field: &'static str,
    value: u64,
    min: u64,
    max: u64,
) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(invalid(field, format!("must be between {min} and {max}")))
    }
}

pub(crate) fn check_key_id(field: &'static str, kid: &str) -> Result<(), ConfigError> {
    if kid.is_empty()
        || kid.len() > 32
        || !kid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(invalid(field, "1 to 32 characters from [A-Za-z0-9_-]"));
    }
    Ok(())
}

pub(crate) fn check_http_url(field: &'static str, value: &str) -> Result<(), ConfigError> {
    check_origin(field, value, false).map(|_| ())
}

/// An upstream's origin: `http://host:port` or, with `https`,
/// `https://host:port` too. Returns the scheme.
pub(crate) fn check_upstream_url(
    field: &'static str,
    value: &str,
) -> Result<&'static str, ConfigError> {
    check_origin(field, value, true)
}

fn check_origin(
    field: &'static str,
    value: &str,
    https: bool,
) -> Result<&'static str, ConfigError> {
    let expected = if https {
        "expected http://host:port or https://host:port"
    } else {
        "expected http://host:port"
    };
    let url = url::Url::parse(value)
        .map_err(|e| invalid(field, format!("not a URL ({e}); {expected}")))?;
    let scheme = match url.scheme() {
        "http" => "http",
        "https" if https => "https",
        _ => return Err(invalid(field, expected)),
    };
    if url.host_str().is_none() {
        return Err(invalid(field, expected));
    }
    if !matches!(url.path(), "" | "/") || url.query().is_some() {
        return Err(invalid(
            field,
            "give scheme, host and port only (no path or query)",
        ));
    }
    Ok(scheme)
}

pub(crate) fn check_methods(field: &'static str, methods: &[String]) -> Result<(), ConfigError> {
    for m in methods {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(invalid(
                field,
                format!("`{m}` is not an upper-case HTTP method"),
            ));
        }
    }
    Ok(())
}

pub(crate) fn check_secret(field: &'static str, secret: Vec<u8>) -> Result<Vec<u8>, ConfigError> {
    if secret.len() < 32 {
        return Err(invalid(
            field,
            "the signing secret must be at least 32 bytes",
        ));
    }
    Ok(secret)
}

/// Implements `TryFrom<String>` for a config enum so that an unknown value
/// is reported with the list of allowed ones, and `Serialize` as that name.
macro_rules! config_enum {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl TryFrom<String> for $ty {
            type Error = String;
            fn try_from(value: String) -> Result<Self, String> {
                match value.as_str() {
                    $($name => Ok($ty::$variant),)+
                    other => Err(format!(
                        "unknown value `{other}`; allowed: {}",
                        [$($name),+].join(", ")
                    )),
                }
            }
        }
        impl $ty {
            pub fn as_str(self) -> &'static str {
                match self { $($ty::$variant => $name,)+ }
            }
        }
        /// Written as the name a configuration file uses, so printed
        /// settings load back (`fencer check-config`).
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    };
}
pub(crate) use config_enum;
