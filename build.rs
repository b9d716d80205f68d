//! Records the git commit the binary was built from, so `fencer --version`
//! and `fencer_build_info` name exactly what a user runs (a bug report that
//! says "0.1.0" could be any of hundreds of commits).
//!
//! Outside a git checkout (a source tarball, a crate download) the commit is
//! `FENCER_GIT_COMMIT` if the packager set it, else `unknown`.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=FENCER_GIT_COMMIT");
    let commit = std::env::var("FENCER_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    // Rebuild when HEAD moves: HEAD itself (a checkout) and the ref it
    // names (a commit on the branch). A worktree's git dir holds its HEAD;
    // refs live in the common dir. Paths that do not exist are skipped:
    // cargo would otherwise rebuild every time.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let head = PathBuf::from(&dir).join("HEAD");
        if head.exists() {
            println!("cargo:rerun-if-changed={}", head.display());
        }
        if let (Some(common), Some(r)) = (
            git(&["rev-parse", "--git-common-dir"]),
            git(&["symbolic-ref", "-q", "HEAD"]),
        ) {
            for p in [
                PathBuf::from(&common).join(&r),
                PathBuf::from(&common).join("packed-refs"),
            ] {
                if p.exists() {
                    println!("cargo:rerun-if-changed={}", p.display());
                }
            }
        }
    }
    println!("cargo:rustc-env=FENCER_GIT_COMMIT={commit}");
}
