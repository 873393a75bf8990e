#!/usr/bin/env python3
"""Import circles between the modules of each workspace crate.

    scripts/import-cycles.py [CRATE_SRC_DIR ...]     # default: every crate's src/ in the workspace

Each source file is a module (`a/mod.rs` and `a.rs` are module `a`). An edge A -> B is a path
`crate::b::...` or `super::...` written in A (in a `use` or inline) that names module B or
something in it, resolved to the deepest module file that exists. Edges between a module and its
own ancestors or descendants are containment, not imports, and are left out. Tests (`#[cfg(test)]`
blocks at the end of a file, `tests/` directories) are not read. Prints every strongly connected
component of two or more modules and exits 1 if there is one.
"""

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def crate_dirs():
    for cargo in sorted(ROOT.glob("**/Cargo.toml")):
        if any(p in cargo.parts for p in ("target", ".venv-test", ".venv-attack", "node_modules")):
            continue
        src = cargo.parent / "src"
        if (src / "lib.rs").is_file() or (src / "main.rs").is_file():
            yield src


def module_of(src: Path, file: Path):
    rel = file.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts and parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    # Unit tests at the end of a file.
    cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: cut.start()] if cut else text


def expand_use(body: str):
    """Paths of a `use` tree, braces expanded."""
    body = re.sub(r"\s+", "", body)

    def rec(prefix, s):
        out = []
        depth, start, items = 0, 0, []
        for i, c in enumerate(s):
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            elif c == "," and depth == 0:
                items.append(s[start:i])
                start = i + 1
        items.append(s[start:])
        for it in items:
            if not it:
                continue
            m = re.match(r"^(.*?)::\{(.*)\}$", it)
            if m:
                out += rec(prefix + m.group(1).split("::"), m.group(2))
            elif it.startswith("{") and it.endswith("}"):
                out += rec(prefix, it[1:-1])
            else:
                out.append(prefix + it.split(" as ")[0].split("::"))
        return out

    return rec([], body)


def paths_in(text: str):
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        for p in expand_use(m.group(1)):
            yield p
    for m in re.finditer(r"\b((?:crate|super)(?:::\w+)+)", text):
        yield m.group(1).split("::")


def resolve(mod, path, modules):
    if path[0] == "crate":
        parts = path[1:]
        base = ()
    elif path[0] == "super":
        base = mod
        parts = path
        while parts and parts[0] == "super":
            base = base[:-1]
            parts = parts[1:]
    elif path[0] == "self":
        base, parts = mod, path[1:]
    else:
        return None
    target = base
    for p in parts:
        if target + (p,) in modules:
            target = target + (p,)
        else:
            break
    return target


def related(a, b):
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def sccs(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def check(src: Path):
    files = {}
    for f in sorted(src.rglob("*.rs")):
        if "tests" in f.relative_to(src).parts:
            continue
        files[module_of(src, f)] = f
    modules = set(files)
    edges = {}
    for mod, f in files.items():
        text = strip(f.read_text())
        for path in paths_in(text):
            t = resolve(mod, path, modules)
            if t is None or t == () or related(mod, t):
                continue
            edges.setdefault(mod, set()).add(t)
    circles = [c for c in sccs(sorted(modules), edges) if len(c) > 1]
    return circles, sum(len(v) for v in edges.values()), len(modules)


def main():
    dirs = [Path(a).resolve() for a in sys.argv[1:]] or list(crate_dirs())
    bad = False
    for src in dirs:
        circles, n_edges, n_mods = check(src)
        name = os.path.relpath(src.parent, ROOT)
        if circles:
            bad = True
            for c in circles:
                print(f"{name}: circle: " + " -> ".join("::".join(m) for m in sorted(c)))
        else:
            print(f"{name}: {n_mods} modules, {n_edges} import edges, no circle")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
