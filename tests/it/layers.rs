//! The modules of src/ depend on each other one way: each may use only
//! modules of a lower layer (ARCHITECTURE.md, "Layers"). This test reads
//! every `crate::<module>` path in the sources, so a new import that points
//! up a layer fails CI.

use std::collections::BTreeSet;
use std::path::Path;

/// The layers, lowest first: a module may use those before it.
const LAYERS: &[&str] = &[
    "protocol",    // the wire format, no runtime state
    "client_addr", // where a client connected from (TCP, or the Unix socket's peer)
    "config",      // the configuration and its table of settings
    "shards",      // one current-thread runtime per worker thread
    "accept",      // accepting sockets with back-off
    "listen",      // the clients' listening socket (SO_REUSEPORT, the backlog at close)
    "unix_listen", // the clients' Unix-domain socket (stale files, take-over)
    "logging",
    "tls",
    "metrics",
    "backend", // server connections
    "auth",    // client authentication (its auth query uses backend)
    "pool",
    "hooks",
    "frontend", // client sessions
    "admin",    // the console (served over a client's stream)
    "app",      // the running pooler: owns the hook files and reload
    "signals",  // SIGHUP, SIGTERM, ... (what they do is App's and admin's)
];

/// `crate::<name>` paths in a file's code (comments and the test module
/// at its end left out, as they do not make a dependency of the module;
/// everything before it is read, `#[cfg(test)]` items too).
fn imports(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("mod tests {") {
            break;
        }
        let code = line.split("//").next().unwrap_or_default();
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

fn files(path: &Path, out: &mut Vec<std::path::PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            files(&entry.unwrap().path(), out);
        }
    } else if path.extension().is_some_and(|e| e == "rs")
        && !path.parent().is_some_and(|p| p.ends_with("tests"))
    {
        out.push(path.to_path_buf());
    }
}

#[test]
fn modules_depend_on_lower_layers_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
    let mut edges = BTreeSet::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let module = path.file_stem().unwrap().to_string_lossy().into_owned();
        if module == "lib" || module == "main" {
            continue; // the roots: they may use everything
        }
        assert!(
            rank(&module).is_some(),
            "src/{module}: a new module; give it a layer in tests/it/layers.rs and ARCHITECTURE.md"
        );
        let mut sources = Vec::new();
        files(&path, &mut sources);
        for file in sources {
            let text = std::fs::read_to_string(&file).unwrap();
            for used in imports(&text) {
                if used != module && rank(&used).is_some() {
                    edges.insert((module.clone(), used));
                }
            }
        }
    }
    let mut upward = Vec::new();
    for (from, to) in &edges {
        if rank(to) > rank(from) {
            upward.push(format!("{from} -> {to}"));
        }
    }
    assert!(
        upward.is_empty(),
        "imports that point up a layer (see LAYERS in tests/it/layers.rs):\n{}",
        upward.join("\n")
    );
}

/// No two source files share a name in different folders (`mod.rs` and
/// `error.rs`, each layer's own error types, aside):
/// a name says which side it is on (`client_stream.rs`, `server_stream.rs`),
/// so a newcomer never has to ask which `stream.rs` is meant.
#[test]
fn source_file_names_are_unique() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = Vec::new();
    files(&src, &mut sources);
    let mut seen = std::collections::BTreeMap::new();
    let mut twice = Vec::new();
    for file in sources {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if name == "mod.rs" || name == "error.rs" {
            continue;
        }
        let shown = file.strip_prefix(&src).unwrap().display().to_string();
        if let Some(first) = seen.insert(name, shown.clone()) {
            twice.push(format!("{first} and {shown}"));
        }
    }
    assert!(twice.is_empty(), "file names used twice: {twice:?}");
}
