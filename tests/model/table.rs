//! `docs/model.md` maps each transition of the model to the function in
//! `src/` that implements it. This keeps that table from rotting: every
//! `path::function` it names must be defined in that file.

use std::path::Path;

pub fn check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/model.md")).expect("docs/model.md");
    let mut checked = 0;
    let mut missing = Vec::new();
    for line in doc.lines().filter(|l| l.starts_with('|')) {
        // Every `src/…rs::name` in backticks in a table row.
        for cell in line.split('`').skip(1).step_by(2) {
            let Some((file, func)) = cell.split_once(".rs::") else {
                continue;
            };
            if !file.starts_with("src/") {
                continue;
            }
            let path = root.join(format!("{file}.rs"));
            let Ok(text) = std::fs::read_to_string(&path) else {
                missing.push(format!("{cell}: no file {}", path.display()));
                continue;
            };
            // `Type::method` or `function`: the last segment must be defined.
            let name = func.rsplit("::").next().unwrap();
            let defined = [
                format!("fn {name}("),
                format!("fn {name}<"),
                format!("const {name}:"),
                format!("struct {name} "),
                format!("struct {name}<"),
                format!("CREATE FUNCTION {name}("),
            ]
            .iter()
            .any(|d| text.contains(d.as_str()));
            if !defined {
                missing.push(format!("{cell}: `{name}` is not defined in {file}.rs"));
            }
            checked += 1;
        }
    }
    assert!(
        missing.is_empty(),
        "docs/model.md names code that is not there:\n{}",
        missing.join("\n")
    );
    assert!(
        checked >= 20,
        "only {checked} functions named in docs/model.md's table"
    );
}
