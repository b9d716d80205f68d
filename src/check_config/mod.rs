//! `fencer check-config`: a configuration an operator can trust before it
//! is rolled out.
//!
//! - [`role`] — which role the configuration is for, and the checks that
//!   role's start runs (exit 0 here ⇒ that start does not exit 2);
//! - [`files`] — the secret, CA, certificate and key files it points at:
//!   there, readable, and parseable;
//! - [`print`] — the effective settings as redacted TOML, each value set by
//!   a `FENCER__` variable marked with its name;
//! - [`live`] — `--live`: connect to what the role uses, one table row each.
//!
//! Exit codes: 0 ok; 1 a `--live` check failed; 2 a configuration error
//! (the same code the roles exit with for one).

mod files;
pub mod live;
mod print;
pub mod role;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::ExitCode;

pub use role::Role;

use crate::settings::Settings;
use crate::{errln, outln};

/// Exit code for a configuration error, as the roles use it.
const EXIT_CONFIG: u8 = 2;

#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// The role to check the configuration for. Default: inferred —
    /// `backend.kind` set: sidecar; `gateway.fence_store` set, or
    /// `[gateway]` without `[sidecar]`/`[proxy]`/`[backend]`: gateway;
    /// `[inject]`: inject; `[storage]`: storage; else only the checks every
    /// role shares.
    #[arg(long, value_enum)]
    pub role: Option<Role>,
    /// Also connect to what the role uses (lock backend, gateway, fence
    /// store, upstream) and print one row per check; exit 1 if any fails.
    #[arg(long)]
    pub live: bool,
    /// Do not read the secret, certificate and key files or secret
    /// variables the configuration names (checking a manifest on a machine
    /// without its mounts); everything else is still checked.
    #[arg(long)]
    pub no_files: bool,
}

/// Runs the check on loaded (hence already generally valid) `settings`.
pub fn run(settings: &Settings, config: Option<&Path>, args: &CheckArgs) -> ExitCode {
    let sections = named_sections(config);
    let (role, why) = match args.role {
        Some(r) => (Some(r), "--role"),
        None => match Role::infer(settings, &sections) {
            Some((r, why)) => (Some(r), why),
            None => (None, ""),
        },
    };
    if let Some(role) = role {
        let errors = role::check(settings, role, !args.no_files);
        if !errors.is_empty() {
            for e in &errors {
                errln!("fencer: configuration error: {e}");
            }
            errln!(
                "fencer: {} configuration error(s) for the {} role",
                errors.len(),
                role.name()
            );
            return ExitCode::from(EXIT_CONFIG);
        }
        if role == Role::Sidecar {
            for w in settings.sidecar_warnings() {
                errln!("fencer: warning: {w}");
            }
        }
    }
    if args.live {
        let Some(role) = role else {
            errln!("fencer: configuration error: --live needs a role: no role could be inferred; pass --role sidecar|gateway|storage");
            return ExitCode::from(EXIT_CONFIG);
        };
        return live(settings, role);
    }
    let header = match role {
        Some(r) => format!(
            "# configuration ok for the {} role ({why})",
            r.name()
        ),
        None => "# configuration ok (no role inferred: only the checks every role shares ran; pass --role sidecar|gateway|inject|storage|dev to check a role's files and start-up rules)".to_owned(),
    };
    let env = print::env_settings(std::env::vars());
    let text = match print::render(&settings.redacted(), role, &env) {
        Ok(t) => t,
        Err(e) => {
            errln!("fencer: cannot print the configuration as TOML: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A reader that has gone (`check-config | head -1`) has what it
    // wanted: stop printing, still exit 0.
    if outln!("{header}") && !env.is_empty() {
        outln!("# a trailing `# FENCER__…` names the environment variable that set the value");
    }
    outln!("\n{text}");
    ExitCode::SUCCESS
}

/// `--live`: the table on stdout; exit 0 when every check passed, else 1.
fn live(settings: &Settings, role: Role) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            errln!("fencer: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rows = runtime.block_on(live::run(settings, role));
    // Backends keep reconnecting in the background; do not wait for them.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    if rows.is_empty() {
        outln!(
            "the {} role connects to nothing: no live checks",
            role.name()
        );
        return ExitCode::SUCCESS;
    }
    outln!("{}", live::table(&rows));
    let failed = rows.iter().filter(|r| !r.ok).count();
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        errln!("fencer: {failed} of {} live checks failed", rows.len());
        ExitCode::FAILURE
    }
}

/// The top-level sections the file or a `FENCER__` variable names (role
/// inference looks at what the operator wrote, not at defaults).
fn named_sections(config: Option<&Path>) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = config
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| t.parse::<toml::Table>().ok())
        .map(|t| t.keys().cloned().collect())
        .unwrap_or_default();
    for path in print::env_settings(std::env::vars()).keys() {
        if let Some(section) = path.split('.').next() {
            out.insert(section.to_owned());
        }
    }
    out
}
