//! The crate's modules import downward only: no circle among the `crate::x` / `super::x`
//! imports between the files of `src/` (test modules, inline or in a `tests.rs`, left out), so
//! the code generators stay readable, testable and reusable without the device runtime (see
//! the layers in `lib.rs`).
//! Runs without a GPU (and skips where the sources are not, as in the GPU bundle).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every `.rs` file under `dir`, recursively.
fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.file_name().is_some_and(|n| n == "tests.rs") {
            // a test module in a file of its own (`#[cfg(test)] mod tests;`): left out
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Module (a top-level file or directory of `src/`) → modules it names.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut mods = BTreeSet::new();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.is_dir() || (p.extension().is_some_and(|x| x == "rs") && name != "lib") {
            mods.insert(name);
        }
    }
    let mut g = BTreeMap::new();
    for m in &mods {
        let mut fs = Vec::new();
        let file = src.join(format!("{m}.rs"));
        if file.exists() {
            fs.push(file);
        }
        if src.join(m).is_dir() {
            files(&src.join(m), &mut fs);
        }
        let mut uses = BTreeSet::new();
        for f in fs {
            let text = std::fs::read_to_string(&f).unwrap();
            let text = text.split("#[cfg(test)]").next().unwrap();
            for prefix in ["crate::", "super::"] {
                for (i, _) in text.match_indices(prefix) {
                    let rest = &text[i + prefix.len()..];
                    let end = rest
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(rest.len());
                    let name = &rest[..end];
                    if name != m && mods.contains(name) {
                        uses.insert(name.to_string());
                    }
                }
            }
        }
        g.insert(m.clone(), uses);
    }
    g
}

fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn dfs(
        u: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        stack.push(u.to_string());
        seen.insert(u.to_string());
        for v in &g[u] {
            if let Some(i) = stack.iter().position(|s| s == v) {
                let mut c = stack[i..].to_vec();
                c.push(v.clone());
                found.push(c);
            } else if !seen.contains(v) {
                dfs(v, g, stack, seen, found);
            }
        }
        stack.pop();
    }
    let (mut seen, mut found) = (BTreeSet::new(), Vec::new());
    for m in g.keys() {
        if !seen.contains(m) {
            dfs(m, g, &mut Vec::new(), &mut seen, &mut found);
        }
    }
    found
}

#[test]
fn modules_import_downward_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if !src.is_dir() {
        // a test binary carried to another machine (the GPU bundle) without the sources
        eprintln!("skipped: no sources at {}", src.display());
        return;
    }
    let g = graph(&src);
    assert!(
        g.contains_key("codegen") && g.contains_key("device"),
        "{g:?}"
    );
    let cs = circles(&g);
    let text: Vec<String> = cs.iter().map(|c| c.join(" -> ")).collect();
    assert!(cs.is_empty(), "import circles:\n{}", text.join("\n"));
    // the code generators import no runtime module
    for pure in ["codegen", "sources"] {
        for runtime in ["device", "memory", "storage", "lazy", "nvrtc"] {
            assert!(!g[pure].contains(runtime), "{pure} imports {runtime}");
        }
    }
}

/// The check finds a circle when there is one.
#[test]
fn a_circle_is_found() {
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    g.insert("c".to_string(), BTreeSet::new());
    assert_eq!(circles(&g), vec![vec!["a", "b", "a"]]);
}
