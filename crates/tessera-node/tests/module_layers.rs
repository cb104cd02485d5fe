//! The node's modules form layers: no module reaches, through `crate::`
//! paths, a module that reaches it back. (The cluster wing sits above the
//! commands, the commands above the node state; a circle would let changes in one
//! ripple without end through the others.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module of `src/` and the top-level modules it names.
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![source.clone()];
    while let Some(path) = pending.pop() {
        if path.is_dir() {
            pending.extend(std::fs::read_dir(&path).unwrap().map(|entry| entry.unwrap().path()));
            continue;
        }
        if path.extension().is_none_or(|extension| extension != "rs") {
            continue;
        }
        let relative = path.strip_prefix(&source).unwrap();
        let module = relative.iter().next().unwrap().to_string_lossy().trim_end_matches(".rs").to_string();
        if module == "lib" {
            continue;
        }
        // Comments may name any module (doc links); only code depends.
        let text: String = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .filter(|line| !line.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let named = graph.entry(module.clone()).or_default();
        for (index, _) in text.match_indices("crate::") {
            let rest = &text[index + "crate::".len()..];
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty()
                && name != module
                && name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
            {
                named.insert(name);
            }
        }
    }
    graph
}

/// A cycle through `module`, if there is one.
fn cycle_from(graph: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>) -> Option<Vec<String>> {
    let current = path.last().unwrap().clone();
    for next in graph.get(&current).into_iter().flatten() {
        if let Some(start) = path.iter().position(|seen| seen == next) {
            let mut cycle = path[start..].to_vec();
            cycle.push(next.clone());
            return Some(cycle);
        }
        path.push(next.clone());
        if let Some(cycle) = cycle_from(graph, path) {
            return Some(cycle);
        }
        path.pop();
    }
    None
}

#[test]
fn the_nodes_modules_have_no_circles() {
    let graph = dependencies();
    assert!(
        graph.contains_key("cluster") && graph.contains_key("node_state"),
        "the sources were found: {graph:?}"
    );
    for module in graph.keys() {
        if let Some(cycle) = cycle_from(&graph, &mut vec![module.clone()]) {
            panic!("modules in a circle: {}", cycle.join(" -> "));
        }
    }
}
