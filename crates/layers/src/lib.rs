//! # layers — the file-tower check of every crate's `tests/layers.rs`
//!
//! Inside a crate the files form a tower: each names (a `crate::` path in its code;
//! comments, strings and `#[cfg(test)] mod` blocks are not looked at) only files
//! placed below it in the crate's `ORDER`, and no `super::` path outside test
//! modules. [`check`] scans the crate's `src/` and panics with each violation; a
//! crate's `tests/layers.rs` holds its `ORDER` and calls it. Dev-only: no
//! dependencies, used by the crates' integration tests.

use std::collections::BTreeMap;
use std::path::Path;

/// `src` without comments, string and char contents, and `#[cfg(test)] mod` blocks.
fn code_of(src: &str) -> String {
    // Comments and literals first (so braces and `//` inside them do not count).
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
            continue;
        }
        if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
            continue;
        }
        // A char literal ('x', '\n', '\''); a lifetime ('a) is left alone.
        if c == b'\'' {
            let lit = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..]
                    .iter()
                    .position(|&x| x == b'\'')
                    .map(|p| i + 2 + p + 1)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 3)
            } else {
                None
            };
            if let Some(end) = lit {
                out.push_str("' '");
                i = end;
                continue;
            }
        }
        out.push(c as char);
        i += 1;
    }
    // Then the test modules.
    let mut code = out;
    while let Some(at) = find_test_mod(&code) {
        let open = at + code[at..].find('{').expect("test module body");
        let mut depth = 0;
        let mut end = open;
        for (k, ch) in code[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        code.replace_range(at..end, "");
    }
    code
}

/// Start of the first `#[cfg(test)]` attribute that is followed by a `mod`.
fn find_test_mod(code: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(p) = code[from..].find("#[cfg(test)]") {
        let at = from + p;
        let rest = code[at + "#[cfg(test)]".len()..].trim_start();
        if rest.starts_with("mod ")
            || rest.starts_with("pub mod ")
            || rest.starts_with("pub(crate) mod ")
        {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// The paths a `crate::` use tree or expression starting at `s` names (groups
/// expanded; `self`, `*` and renames dropped).
fn paths(s: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let b = s.as_bytes();
    let mut i = 0;
    let mut cur = prefix;
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if i < b.len() && b[i] == b'{' {
            i += 1;
            loop {
                i += paths(&s[i..], cur.clone(), out);
                while i < b.len() && b[i].is_ascii_whitespace() {
                    i += 1;
                }
                match b.get(i) {
                    Some(b',') => i += 1,
                    Some(b'}') => return i + 1,
                    _ => return i,
                }
                while i < b.len() && b[i].is_ascii_whitespace() {
                    i += 1;
                }
                if b.get(i) == Some(&b'}') {
                    return i + 1;
                }
            }
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'*') {
            i += 1;
        }
        let seg = &s[start..i];
        if !seg.is_empty() && seg != "self" && seg != "*" {
            cur.push(seg.to_string());
        }
        if s[i..].starts_with("::") {
            i += 2;
            continue;
        }
        // A rename (`x as y`) in a use tree.
        let rest = s[i..].trim_start();
        if let Some(r) = rest.strip_prefix("as ") {
            let skip = s.len() - r.len();
            let r2 = r.trim_start();
            let n = r2
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(r2.len());
            i = skip + (r.len() - r2.len()) + n;
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        return i;
    }
}

/// The file a `crate::` path names, or an error.
fn resolve(
    path: &[String],
    files: &BTreeMap<String, usize>,
    dirs: &[&str],
) -> Result<String, String> {
    let first = path.first().map(String::as_str).unwrap_or("");
    if dirs.contains(&first) {
        if let Some(second) = path.get(1) {
            let f = format!("{first}/{second}");
            if files.contains_key(&f) {
                return Ok(f);
            }
        }
        return Ok(format!("{first}/mod"));
    }
    if files.contains_key(first) && first != "lib" {
        return Ok(first.to_string());
    }
    Err(format!(
        "`crate::{}` is a crate-root re-export or unknown: name the module",
        path.join("::")
    ))
}

/// Checks the crate at `manifest_dir` (its `src/`): every file is placed in `order`
/// (layers bottom first, and in each its files bottom first, as paths under `src/`
/// without `.rs`; `dirs` are the module directories), and names through `crate::`
/// only files placed before it; no `super::` outside test modules; only `lib.rs`
/// uses the crate root's re-exports. Panics with every violation found, or if the
/// scan found at most `min_edges` imports (it would no longer be reading the files).
pub fn check(manifest_dir: &str, order: &[(&str, &[&str])], dirs: &[&str], min_edges: usize) {
    let src = Path::new(manifest_dir).join("src");
    let mut files = BTreeMap::new();
    let mut layer_of = BTreeMap::new();
    for (layer, list) in order {
        for f in *list {
            let rank = files.len();
            assert!(
                files.insert(f.to_string(), rank).is_none(),
                "{f} listed twice"
            );
            layer_of.insert(f.to_string(), *layer);
        }
    }
    // Every source file is placed.
    let mut on_disk = Vec::new();
    let mut todo = vec![src.clone()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(&src).unwrap().with_extension("");
                on_disk.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    on_disk.sort();
    let mut problems = Vec::new();
    for f in &on_disk {
        if !files.contains_key(f) {
            problems.push(format!("src/{f}.rs is not placed in tests/layers.rs ORDER"));
        }
    }
    for f in files.keys() {
        if !on_disk.contains(f) {
            problems.push(format!("src/{f}.rs is listed in ORDER but does not exist"));
        }
    }
    let mut edges = 0;
    for (f, &rank) in &files {
        let Ok(text) = std::fs::read_to_string(src.join(format!("{f}.rs"))) else {
            continue;
        };
        let code = code_of(&text);
        if f != "lib" && code.contains("super::") {
            problems.push(format!("src/{f}.rs: `super::` outside a test module"));
        }
        if f == "lib" {
            continue;
        }
        let mut from = 0;
        while let Some(p) = code[from..].find("crate::") {
            let at = from + p + "crate::".len();
            // `$crate::` in a macro is the crate itself too.
            let mut named = Vec::new();
            let used = paths(&code[at..], Vec::new(), &mut named);
            from = at + used.max(1);
            for path in named {
                match resolve(&path, &files, dirs) {
                    Err(e) => problems.push(format!("src/{f}.rs: {e}")),
                    Ok(target) if target == *f => {}
                    Ok(target) => {
                        edges += 1;
                        if files[&target] > rank {
                            let (lf, lt) = (layer_of[f], layer_of[&target]);
                            let what = if lf == lt {
                                "a file above it in its layer (a circle, or ORDER is wrong)"
                            } else {
                                "a file of a layer above it"
                            };
                            problems.push(format!(
                                "src/{f}.rs ({lf}) imports src/{target}.rs ({lt}), {what}: crate::{}",
                                path.join("::")
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(
        edges > min_edges,
        "the scan found only {edges} imports: is it still reading the files?"
    );
    assert!(
        problems.is_empty(),
        "layering violations:\n  {}",
        problems.join("\n  ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scanner_sees_what_it_must() {
        let code = code_of(
            "use crate::a::{b, c::{d, e as f}};\n// crate::x::y\nlet s = \"crate::q\";\n\
             #[cfg(test)]\nmod tests { use crate::t; }\nfn g() { crate::h::i(); }\n",
        );
        let mut out = Vec::new();
        let mut from = 0;
        while let Some(p) = code[from..].find("crate::") {
            let at = from + p + 7;
            from = at + paths(&code[at..], Vec::new(), &mut out).max(1);
        }
        let got: Vec<String> = out.iter().map(|p| p.join("::")).collect();
        assert_eq!(got, ["a::b", "a::c::d", "a::c::e", "h::i"]);
    }
}
