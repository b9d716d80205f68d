//! The client libraries in `clients/`, installed the way a user would.

use std::path::Path;
use std::process::Command;

/// Makes `dir` a Node project (ES modules) with `clients/node` installed by
/// `npm install` from its folder, offline; `import 'fencer-client'` works
/// from there. ES modules find packages in `node_modules` only (no
/// `NODE_PATH`), so this is how a copy of the examples gets the library.
pub fn install_node_client(dir: &Path) {
    super::require_tool("the Node client", "npm", "npm", "npm", &["--version"]);
    std::fs::write(
        dir.join("package.json"),
        r#"{"name":"fencer-client-user","private":true,"type":"module"}"#,
    )
    .unwrap();
    let out = Command::new("npm")
        .args([
            "install",
            "--offline",
            "--no-audit",
            "--no-fund",
            "--silent",
        ])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/node"))
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "npm install clients/node: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
