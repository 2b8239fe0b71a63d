//! The crate's layering, checked from its source (docs/design.md §1): the top-level modules form
//! no cycle, the pure coordinator knows nothing of Redis or of the runtime, and the poller does not
//! reach back into the member runtime that spawns it.
//!
//! The check reads `src/` as text: every `crate::<module>` path outside comments, including grouped
//! imports (`use crate::{a::X, b}`), is an edge from the file's top-level module to `<module>`. Test
//! code counts too: a test that needs a higher layer is a sign the lower one is missing a seam.
//! The one exception is `testing` (feature `testing`): the real-Redis harness sits above every
//! layer (its workload process runs a whole listener), and every layer's tests start their
//! servers with it, so it is not a node of the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Top-level module name → the top-level modules its files name through `crate::`.
type ModuleGraph = BTreeMap<String, BTreeSet<String>>;

fn source_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The `.rs` files of one top-level module: `src/<name>.rs` and everything under `src/<name>/`.
fn module_files(root: &Path, name: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let single = root.join(format!("{name}.rs"));
    if single.is_file() {
        files.push(single);
    }
    let mut folders = vec![root.join(name)];
    while let Some(folder) = folders.pop() {
        let Ok(entries) = fs::read_dir(&folder) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("readable source folder").path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files
}

/// The top-level modules of the crate: every `src/*.rs` but `lib.rs`, and every folder of `src/`,
/// except the `testing` harness.
fn top_level_modules(root: &Path) -> BTreeSet<String> {
    fs::read_dir(root)
        .expect("src/ is readable")
        .map(|entry| entry.expect("readable entry").path())
        .filter_map(|path| {
            let stem = path.file_stem()?.to_str()?.to_owned();
            let is_module = path.is_dir() || path.extension().is_some_and(|e| e == "rs");
            (is_module && stem != "lib" && stem != "testing").then_some(stem)
        })
        .collect()
}

/// The source without comments: line comments (`//`, `///`, `//!`) and block comments. String
/// literals are kept; a `//` inside one (a URL) only shortens what is scanned of that line.
fn without_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |end| &after[end + 2..]);
        } else if rest.starts_with("//") {
            rest = rest.find('\n').map_or("", |end| &rest[end..]);
        } else {
            let ch = rest.chars().next().expect("non-empty");
            out.push(ch);
            rest = &rest[ch.len_utf8()..];
        }
    }
    out
}

/// The leading identifier of `text`, if it starts with one.
fn leading_ident(text: &str) -> Option<&str> {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    (end > 0).then(|| &text[..end])
}

/// Every top-level name a source names after `crate::`, grouped imports included.
fn crate_paths(source: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (at, _) in source.match_indices("crate::") {
        let after = &source[at + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            names.extend(group_heads(group));
        } else if let Some(name) = leading_ident(after) {
            names.insert(name.to_owned());
        }
    }
    names
}

/// The first path segment of each item of a `{ ... }` group (the text after its `{`), up to the
/// matching `}`: `a::X, b::{c, d}, e` gives `a`, `b`, `e`.
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut at_item_start = true;
    for (index, ch) in group.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_item_start = true,
            c if c.is_whitespace() => {}
            _ if at_item_start && depth == 0 => {
                if let Some(name) = leading_ident(&group[index..]) {
                    heads.push(name.to_owned());
                }
                at_item_start = false;
            }
            _ => {}
        }
    }
    heads
}

fn module_graph() -> ModuleGraph {
    let root = source_root();
    let modules = top_level_modules(&root);
    let mut graph = ModuleGraph::new();
    for module in &modules {
        let edges = graph.entry(module.clone()).or_default();
        for file in module_files(&root, module) {
            let source = fs::read_to_string(&file).expect("readable source file");
            for name in crate_paths(&without_comments(&source)) {
                if &name != module && modules.contains(&name) {
                    edges.insert(name);
                }
            }
        }
    }
    graph
}

/// A cycle through the graph as a list of modules (first = last), if there is one.
fn find_cycle(graph: &ModuleGraph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &ModuleGraph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_top_level_modules_form_no_cycle() {
    let graph = module_graph();
    assert!(graph.contains_key("coordinator") && graph.contains_key("poller"));
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "module cycle: {}\nwhole graph: {graph:#?}",
            cycle.join(" -> ")
        );
    }
}

#[test]
fn the_coordinator_names_no_redis_and_no_runtime() {
    let graph = module_graph();
    let runtime = [
        "store",
        "dataplane",
        "connection",
        "member",
        "poller",
        "admin",
        "producer",
    ];
    let reached: Vec<_> = graph["coordinator"]
        .iter()
        .filter(|m| runtime.contains(&m.as_str()))
        .collect();
    assert!(reached.is_empty(), "the coordinator imports {reached:?}");
    for file in module_files(&source_root(), "coordinator") {
        let source = without_comments(&fs::read_to_string(&file).expect("readable"));
        assert!(
            !source.contains("redis::"),
            "{} names the redis crate",
            file.display()
        );
    }
}

#[test]
fn the_poller_does_not_reach_back_into_the_member_runtime_or_admin() {
    let graph = module_graph();
    for (module, forbidden) in [
        ("poller", "member"),
        ("member", "admin"),
        ("poller", "admin"),
    ] {
        assert!(
            !graph[module].contains(forbidden),
            "{module} imports {forbidden}: {graph:#?}"
        );
    }
}

/// Metrics, lifecycle hooks, headers and the trace context (docs/design.md §13) are called by the
/// runtime and know nothing of it: the member and its shard tasks hand them what they record or
/// run (labels, a hook's context), so none of them names the member, the poller or the runtime.
#[test]
fn the_observability_modules_sit_below_the_runtime() {
    let graph = module_graph();
    for module in ["telemetry", "hooks", "headers", "trace_context"] {
        let reached: Vec<_> = graph[module]
            .iter()
            .filter(|m| ["member", "poller", "runtime", "admin"].contains(&m.as_str()))
            .collect();
        assert!(reached.is_empty(), "{module} imports {reached:?}");
    }
}

#[test]
fn the_parser_sees_grouped_and_plain_paths_and_skips_comments() {
    let source = "use crate::{a::X, b::{c, d}, e};\n// crate::commented\nfn f() { crate::g::h(); }\n/* crate::blocked */";
    let names = crate_paths(&without_comments(source));
    let expected: BTreeSet<String> = ["a", "b", "e", "g"].map(String::from).into();
    assert_eq!(names, expected);
}
