//! "Did you mean": an unknown field named with its section, where it came
//! from (the file or a `FENCER__` variable) and the nearest known name.
//!
//! Every settings struct denies unknown fields, so a typo is an error at
//! start-up rather than a setting silently ignored. serde's own message
//! lists all 20-odd fields of the section, which hides the one the operator
//! meant; the nearest by edit distance (transpositions count once:
//! `defualt` → `default`) is almost always it.

/// The message for a loading error: an unknown field gets its section,
/// its variable (when one set it) and the nearest known name; any other
/// error keeps the `config` crate's text.
pub(crate) fn explain(err: &config::ConfigError) -> String {
    let (message, key) = match err {
        config::ConfigError::At { error, key, .. } => match &**error {
            config::ConfigError::Message(m) => (m.as_str(), key.as_deref().unwrap_or("")),
            _ => return err.to_string(),
        },
        config::ConfigError::Message(m) => (m.as_str(), ""),
        _ => return err.to_string(),
    };
    match UnknownField::parse(message, key) {
        Some(u) => u.to_string(),
        None => err.to_string(),
    }
}

/// serde's `unknown field `x`, expected one of `a`, `b`` taken apart.
struct UnknownField {
    /// Dotted path of the section (`backend.redis`); empty at the top.
    section: String,
    field: String,
    known: Vec<String>,
}

impl UnknownField {
    fn parse(message: &str, key: &str) -> Option<UnknownField> {
        let rest = message.strip_prefix("unknown field ")?;
        // Backticked names: the unknown one first, then the expected ones.
        let mut names = rest.split('`').skip(1).step_by(2).map(str::to_owned);
        let field = names.next()?;
        // The `config` crate names the section, or the field within it.
        let section = key
            .strip_suffix(field.as_str())
            .map_or(key, |s| s.trim_end_matches('.'))
            .to_owned();
        Some(UnknownField {
            section,
            field,
            known: names.collect(),
        })
    }

    /// The closest known name, if close enough to be a typo of it: at most
    /// a third of the name's length in edits (and at least 2 allowed).
    fn nearest(&self) -> Option<&str> {
        let limit = (self.field.len() / 3).max(2);
        self.known
            .iter()
            .map(|k| (strsim::osa_distance(&self.field, k), k))
            .filter(|(d, _)| *d <= limit)
            .min_by_key(|(d, _)| *d)
            .map(|(_, k)| k.as_str())
    }

    /// `FENCER__SECTION__FIELD` for a field of this section.
    fn variable(&self, field: &str) -> String {
        let path = if self.section.is_empty() {
            field.to_owned()
        } else {
            format!("{}.{field}", self.section)
        };
        format!("FENCER__{}", path.replace('.', "__").to_uppercase())
    }
}

impl std::fmt::Display for UnknownField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown field \"{}\"", self.field)?;
        if self.section.is_empty() {
            write!(f, " (top level)")?;
        } else {
            write!(f, " in [{}]", self.section)?;
        }
        // Only a plain section can be set from the environment; an
        // unknown section is named by the variables under it.
        let var = self.variable(&self.field);
        let from_env = !self.section.contains('[')
            && std::env::vars_os().any(|(k, _)| {
                k.to_str().is_some_and(|k| {
                    k == var || (self.section.is_empty() && k.starts_with(&format!("{var}__")))
                })
            });
        if from_env {
            let suffix = if self.section.is_empty() { "__…" } else { "" };
            write!(f, " (set by {var}{suffix})")?;
        }
        match self.nearest() {
            Some(n) if from_env && !self.section.is_empty() => {
                write!(f, "; did you mean \"{n}\" ({})?", self.variable(n))
            }
            Some(n) => write!(f, "; did you mean \"{n}\"?"),
            None if self.known.is_empty() => Ok(()),
            None => write!(f, "; known fields: {}", self.known.join(", ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::UnknownField;

    fn explain(message: &str, key: &str) -> String {
        UnknownField::parse(message, key).unwrap().to_string()
    }

    #[test]
    fn a_typo_gets_the_nearest_name_and_its_section() {
        let m = "unknown field `defualt_ttl_ms`, expected one of `listen`, `default_ttl_ms`, `default_wait_ms`";
        assert_eq!(
            explain(m, "sidecar"),
            "unknown field \"defualt_ttl_ms\" in [sidecar]; did you mean \"default_ttl_ms\"?"
        );
        assert_eq!(
            explain(m, "sidecar.defualt_ttl_ms"),
            "unknown field \"defualt_ttl_ms\" in [sidecar]; did you mean \"default_ttl_ms\"?"
        );
        let top = "unknown field `sidcar`, expected one of `sidecar`, `proxy`, `gateway`";
        assert_eq!(
            explain(top, ""),
            "unknown field \"sidcar\" (top level); did you mean \"sidecar\"?"
        );
    }

    #[test]
    fn nothing_close_lists_the_known_fields() {
        let m = "unknown field `colour`, expected one of `level`, `format`";
        assert_eq!(
            explain(m, "log"),
            "unknown field \"colour\" in [log]; known fields: level, format"
        );
        assert!(UnknownField::parse("invalid type: string", "log").is_none());
    }
}
