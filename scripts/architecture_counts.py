"""Measure the structure of the grpo_fast package in a checkout (stdlib only).

Usage:
    python scripts/architecture_counts.py [ROOT] [--verbose] [--json]

ROOT is a checkout (default: the one this script sits in); only ROOT/grpo_fast is
scanned (not ROOT/kernels, tests or scripts). To measure an old commit, check it out
beside this one and point the script at it (the script need not exist there):

    git worktree add -f /tmp/counts_old a51fb0f
    python scripts/architecture_counts.py /tmp/counts_old
    git worktree remove --force /tmp/counts_old

The counts:

1. Whole-config signatures: every `def`/`async def` (lambdas not counted) with a
   parameter named `config`, or with any parameter whose annotation text contains
   `GRPOConfig` (a string annotation too). Total and per file; --verbose lists them.
2. Long files: files over 400 physical lines, with their line counts.
3. Import graph between the package's modules. `import grpo_fast.x`, `from grpo_fast.x
   import y` and relative imports are resolved; `from P import name` points at P.name when
   that is a module of the package, else at P. Each import is one of three kinds:
   "module" (runs at import time: top level, incl. inside if/try/class bodies),
   "function" (inside a def, at any depth), "typing" (under `if TYPE_CHECKING:`).
   Importing a.b.c also runs the a and a.b __init__s; those implicit edges are left out,
   and so are dynamic imports (importlib.import_module, e.g. modes/__init__.py's modes).
   Import circles are the strongly connected components of more than one module, once
   for module-level imports only and once for all imports.
4. Upward imports: each module gets the layer of the first matching prefix of LAYERS
   (path relative to grpo_fast/, longest prefix first; a "x.py" prefix matches that file
   only, an "x/" prefix everything under it). Imports whose target has a higher layer
   than their source are upward; counted and listed per kind. Modules matching no
   prefix are printed as "unlayered". `grpo_fast.kernels` (the top-level kernels/
   folder, installed under that name) and `grpo_fast._C` (the compiled csrc/ kernels)
   are not files in grpo_fast/ but are layered as kernels when imported.
   Also printed: for each package area (top-level folder or root module) its number
   of modules and lines.
"""
import argparse
import ast
import json
import os
import sys

PACKAGE = "grpo_fast"
LONG_FILE = 400
LAYERS = [  # (layer name, path prefixes relative to grpo_fast/), lowest first: the data path of a step
    #   (docs/design.md, "Layout"); the old homes of a51fb0f's flat layout are listed beside the new ones
    ("base", ["errors.py", "bounds.py", "registry.py", "compat.py", "objective.py", "loss_types.py", "options.py",
              "processes.py"]),
    ("kernels", ["ops/", "kernels/", "_C/"]),
    ("models and ranks", ["models/", "distributed.py"]),
    ("generation", ["generation/", "rollout/", "modes/", "agents/"]),
    ("rewards", ["rewards/", "sandbox.py"]),
    ("data", ["data/"]),
    ("reporting", ["reporting/", "metrics.py", "trackers.py", "completions_table.py"]),
    ("training stages", ["train/"]),
    ("config", ["config.py", "config_checks.py"]),
    ("run", ["run/", "checkpoint.py", "resume.py", "run_folder.py"]),
    ("loop and entry points", ["trainer.py", "cli.py", "launcher.py", "integrations/", "__init__.py", "__main__.py"]),
]
PREFIXES = sorted(((p, i) for i, (_, ps) in enumerate(LAYERS) for p in ps),
                  key=lambda pi: -len(pi[0]))


def layer_of(rel):
    """Layer index of a path relative to grpo_fast/, or None when unlayered."""
    for prefix, index in PREFIXES:
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            return index
    return None


def load_modules(pkg_dir):
    """{module name: (relative path, source text)} for every .py file of the package."""
    modules = {}
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), pkg_dir).replace(os.sep, "/")
                parts = [PACKAGE] + rel[:-3].split("/")
                if parts[-1] == "__init__":
                    parts.pop()
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    modules[".".join(parts)] = (rel, f.read())
    return modules


def rel_of(module, modules):
    """Path relative to grpo_fast/ (a pseudo-path "x/y/" for targets without a file)."""
    return modules[module][0] if module in modules else "/".join(module.split(".")[1:]) + "/"


def is_type_checking(test):
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def walk(node, kind="module"):
    """Yield (node, import kind) for every node below `node`."""
    for child in ast.iter_child_nodes(node):
        yield child, kind
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from walk(child, "function")
        elif isinstance(child, ast.If) and kind == "module" and is_type_checking(child.test):
            for sub, sub_kind in [(s, "typing") for s in child.body] + [(s, kind) for s in child.orelse]:
                yield sub, sub_kind
                yield from walk(sub, sub_kind)
        else:
            yield from walk(child, kind)


def import_targets(node, module, is_pkg, modules):
    """Package modules an Import/ImportFrom node points at."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
            base = ".".join(parts + ([base] if base else []))
        names = []
        for alias in node.names:
            sub = base + "." + alias.name
            names.append(sub if sub in modules or sub.startswith(PACKAGE + "._C") else base)
    return sorted({n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")})


def sccs(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def measure(root):
    modules = load_modules(os.path.join(root, PACKAGE))
    signatures, long_files, imports, areas = [], [], [], {}
    for module, (rel, text) in modules.items():
        lines = len(text.splitlines())
        if lines > LONG_FILE:
            long_files.append((rel, lines))
        area = rel.split("/")[0]
        count, total = areas.get(area, (0, 0))
        areas[area] = (count + 1, total + lines)
        tree = ast.parse(text, filename=rel)
        for node, kind in walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
                if any(p.arg == "config" or (p.annotation is not None
                       and "GRPOConfig" in ast.unparse(p.annotation)) for p in params):
                    signatures.append((rel, node.lineno, node.name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in import_targets(node, module, rel.endswith("__init__.py"), modules):
                    if target != module:
                        imports.append((module, node.lineno, target, kind))
    per_file = {}
    for rel, _, _ in signatures:
        per_file[rel] = per_file.get(rel, 0) + 1
    module_graph, full_graph = {}, {}
    for src, _, dst, kind in imports:
        full_graph.setdefault(src, set()).add(dst)
        if kind == "module":
            module_graph.setdefault(src, set()).add(dst)
    layers = {m: layer_of(rel_of(m, modules)) for m in set(modules) | {i[2] for i in imports}}
    upward = [(src, line, dst, kind) for src, line, dst, kind in imports
              if layers[src] is not None and layers[dst] is not None and layers[src] < layers[dst]]
    return {
        "root": os.path.abspath(root),
        "modules": len(modules),
        "lines": sum(lines for _, lines in areas.values()),
        "config_signatures": len(signatures),
        "config_signatures_per_file": dict(sorted(per_file.items(), key=lambda kv: (-kv[1], kv[0]))),
        "config_signature_list": [f"{rel}:{line} {name}" for rel, line, name in sorted(signatures)],
        "long_files": dict(sorted(long_files, key=lambda rl: -rl[1])),
        "imports_by_kind": {k: sum(1 for i in imports if i[3] == k) for k in ("module", "function", "typing")},
        "circles_module_level": sccs(module_graph),
        "circles_all_imports": sccs(full_graph),
        "upward_by_kind": {k: sum(1 for u in upward if u[3] == k) for k in ("module", "function", "typing")},
        "upward": [f"[{kind}] {rel_of(src, modules)}:{line} -> {dst} "
                   f"({LAYERS[layers[src]][0]} -> {LAYERS[layers[dst]][0]})"
                   for src, line, dst, kind in sorted(upward, key=lambda u: (u[3], u[0], u[1]))],
        "unlayered": sorted(rel_of(m, modules) for m, layer in layers.items() if layer is None),
        "areas": {a: {"modules": c, "lines": n} for a, (c, n) in sorted(areas.items())},
    }


def report(r, verbose):
    out = [f"{r['root']}: {r['modules']} modules, {r['lines']} lines in {PACKAGE}/", "",
           f"1. Signatures taking the whole config: {r['config_signatures']}"]
    out += [f"   {n:3d}  {rel}" for rel, n in r["config_signatures_per_file"].items()]
    if verbose:
        out += ["   list:"] + [f"     {s}" for s in r["config_signature_list"]]
    out += ["", f"2. Files over {LONG_FILE} lines: {len(r['long_files'])}"]
    out += [f"   {n:5d}  {rel}" for rel, n in r["long_files"].items()]
    k = r["imports_by_kind"]
    out += ["", f"3. Imports between package modules: {k['module']} module-level, "
                f"{k['function']} function-level, {k['typing']} TYPE_CHECKING-only"]
    for label, key in (("module-level imports", "circles_module_level"),
                       ("all imports", "circles_all_imports")):
        out.append(f"   Import circles, {label}: {len(r[key])}")
        out += [f"     ({len(c)}) " + ", ".join(c) for c in r[key]]
    u = r["upward_by_kind"]
    out += ["", f"4. Upward imports (lower layer -> higher): {u['module']} module-level, "
                f"{u['function']} function-level, {u['typing']} TYPE_CHECKING-only"]
    out += [f"   {line}" for line in r["upward"]]
    out.append("   Unlayered: " + (", ".join(r["unlayered"]) or "none"))
    out += ["", "   Areas (modules, lines):"]
    out += [f"   {v['modules']:3d} {v['lines']:6d}  {a}" for a, v in r["areas"].items()]
    return "\n".join(out)


def main():
    default_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default=default_root, help="checkout to measure")
    parser.add_argument("--verbose", action="store_true", help="list every config signature")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.root, PACKAGE)):
        sys.exit(f"no {PACKAGE}/ under {args.root}")
    result = measure(args.root)
    print(json.dumps(result, indent=2) if args.json else report(result, args.verbose))


if __name__ == "__main__":
    main()
