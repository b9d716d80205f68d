//! No import cycles between the modules of `src/`.
//!
//! A cycle means two modules can only be understood (and changed) together:
//! the shared part belongs in a leaf module both import. Issue 29 found
//! three; this test draws the graph from the source so a new one fails CI
//! the day it is written, with the cycle printed.
//!
//! The graph: one node per module file (`src/a/b.rs` and `src/a/b/mod.rs`
//! are `a::b`), an edge for every `crate::…` or `super::…` path in the
//! file (imports, re-exports and inline paths alike), resolved to the
//! longest module file that exists. `#[cfg(test)]` modules at the end of a
//! file are left out (their `super::*` is the file itself).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn module_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            module_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/a/b.rs` → `["a", "b"]`; `src/a/mod.rs` → `["a"]`; `src/lib.rs` → `[]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The source without its trailing `#[cfg(test)] mod … { … }` and without
/// comments (doc links name modules without importing them).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|n| n.trim_start().starts_with("mod "))
        {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split(" // ").next().unwrap_or_default());
        out.push('\n');
    }
    out
}

/// Every `crate::x::y…` / `super::x…` path in `code`, as segments relative
/// to the crate root (`use crate::a::{b, c}` yields `a::b` and `a::c`).
fn paths_in(code: &str, module: &[String], is_mod_rs: bool) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for (start, anchor) in [("crate::", 0usize), ("super::", 1usize)] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            // Inside a longer path (`a::super::`, `$crate::`) or a word.
            if at > 0
                && (bytes[at - 1].is_ascii_alphanumeric()
                    || matches!(bytes[at - 1], b'_' | b':' | b'$'))
            {
                continue;
            }
            let mut base: Vec<String> = if anchor == 0 {
                Vec::new()
            } else {
                // `super` of `a/b.rs` is `a`; of `a/b/mod.rs` (module a::b) too.
                let mut m = module.to_vec();
                if !is_mod_rs || !m.is_empty() {
                    m.pop();
                }
                m
            };
            let mut rest = &code[from..];
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            let mut segs = base.clone();
            let mut chars = rest.char_indices().peekable();
            let mut seg = String::new();
            let mut group = None;
            while let Some((j, c)) = chars.next() {
                if c.is_alphanumeric() || c == '_' {
                    seg.push(c);
                } else if c == ':' && rest[j..].starts_with("::") {
                    chars.next();
                    segs.push(std::mem::take(&mut seg));
                    if rest[j + 2..].starts_with('{') {
                        group = Some(j + 3);
                        break;
                    }
                } else {
                    break;
                }
            }
            if !seg.is_empty() {
                segs.push(seg);
            }
            match group {
                Some(g) => {
                    let end = rest[g..].find('}').map_or(rest.len(), |e| g + e);
                    for item in rest[g..end].split(',') {
                        let name: String = item
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        let mut p = segs.clone();
                        if !name.is_empty() && name != "self" {
                            p.push(name);
                        }
                        out.push(p);
                    }
                }
                None => out.push(segs),
            }
        }
    }
    out
}

/// The longest prefix of `path` that is a module file.
fn resolve(path: &[String], modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
}

fn graph() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    module_files(&src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        if module.is_empty() {
            continue; // lib.rs and main.rs: the root declares every module
        }
        let is_mod_rs = file.file_name().is_some_and(|n| n == "mod.rs");
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        let targets = edges.entry(module.clone()).or_default();
        for p in paths_in(&code, &module, is_mod_rs) {
            if let Some(t) = resolve(&p, &modules) {
                // A module's use of its own submodules or of itself is no cycle.
                if !t.starts_with(&module) {
                    targets.insert(t);
                }
            }
        }
    }
    edges
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a Vec<String>) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.g.get(v) {
            for w in ws {
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.join("::"));
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn src_has_no_import_cycles() {
    let g = graph();
    let found = cycles(&g);
    let show: Vec<String> = found
        .iter()
        .map(|c| {
            let members: Vec<String> = c
                .iter()
                .map(|m| {
                    let key: Vec<String> = m.split("::").map(str::to_owned).collect();
                    let into: Vec<String> = g[&key]
                        .iter()
                        .map(|t| t.join("::"))
                        .filter(|t| c.contains(t))
                        .collect();
                    format!("{m} -> {}", into.join(", "))
                })
                .collect();
            members.join("\n    ")
        })
        .collect();
    assert!(
        found.is_empty(),
        "import cycles in src/ (move what both sides need into a leaf module):\n    {}",
        show.join("\n  and\n    ")
    );
}

/// The detector itself: a cycle planted in a tiny tree is found, and
/// `super::`, groups and test modules resolve as documented.
#[test]
fn the_detector_finds_a_planted_cycle() {
    let m = |s: &str| -> Vec<String> { s.split("::").map(str::to_owned).collect() };
    let modules: BTreeSet<Vec<String>> = [m("a"), m("a::b"), m("c")].into_iter().collect();
    let code = code_of(
        "use crate::c::{X, d};\nuse super::super::c;\n// crate::a::b in a comment\n#[cfg(test)]\nmod tests { use crate::a::b; }\n",
    );
    let paths = paths_in(&code, &m("a::b"), false);
    let resolved: BTreeSet<Vec<String>> =
        paths.iter().filter_map(|p| resolve(p, &modules)).collect();
    assert_eq!(resolved, [m("c")].into_iter().collect());
    let mut g = BTreeMap::new();
    g.insert(m("a"), [m("c")].into_iter().collect::<BTreeSet<_>>());
    g.insert(m("c"), [m("a::b")].into_iter().collect());
    g.insert(m("a::b"), [m("a")].into_iter().collect());
    assert_eq!(cycles(&g), vec![vec!["a", "a::b", "c"]]);
}
