"""The import graph of dllm_ops: no circle, and no arrow back up.

Every module of ``dllm_ops/`` is parsed with ``ast`` (nothing is imported, so
this runs even where the package does not): module-level and function-local
imports, relative ones resolved. An import of a submodule also runs its
parent packages' ``__init__``, so the circle check follows those edges too.

The layering rule: ``LAYERS`` lists the layers bottom first; a module may
import only from its own layer or a layer below. Every module must sit in a
layer (a new top-level module takes a decision here). An edge that breaks the
rule today is listed, by name, in ``KNOWN_EXCEPTIONS``; an exception that no
longer occurs makes the test fail, so the list only shrinks.
"""
from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "dllm_ops"

# Bottom first. An entry names a module, or a package and all its submodules.
LAYERS: list[tuple[str, list[str]]] = [
    ("errors", ["dllm_ops.errors"]),
    # import nothing of dllm_ops but errors: the packed-cache layout, RoPE tables,
    # timers, stats records, the toy tokenizer, text options (KEY=VALUE, JSON values)
    ("leaves", ["dllm_ops.packed_layout", "dllm_ops.rope", "dllm_ops.layer_timer",
                "dllm_ops.stats", "dllm_ops.tokenizer", "dllm_ops.options", "dllm_ops._version"]),
    # the typed decode configuration (data: validated, JSON-able; parses text via options)
    ("config", ["dllm_ops.config"]),
    # the ops, their fake kernels, the float64 oracles, the step plan / KV cache
    ("kernels", ["dllm_ops.ops", "dllm_ops._fake", "dllm_ops.reference", "dllm_ops.plan"]),
    ("models", ["dllm_ops.models"]),
    # what a decode plugs in: cache policies, KV storage and quantization, reveal rules
    ("methods", ["dllm_ops.quant", "dllm_ops.policies", "dllm_ops.reveal"]),
    ("reuse", ["dllm_ops.dare"]),
    # the loop and the pieces split out of it
    ("decode", ["dllm_ops.decode", "dllm_ops.commit", "dllm_ops.state", "dllm_ops.prompts"]),
    # the package root re-exports the public API
    ("api", ["dllm_ops"]),
    ("entry points", ["dllm_ops.__main__", "dllm_ops.cli", "dllm_ops.model_flags",
                      "dllm_ops.lm_eval_model", "dllm_ops.lm_eval_ranks", "dllm_ops.likelihood",
                      "dllm_ops.calibrate", "dllm_ops.tasks", "dllm_ops.serve"]),
]

# (importer, imported): upward edges the code has today. Delete an entry with
# the change that removes its import (the test fails on a stale entry).
KNOWN_EXCEPTIONS: list[tuple[str, str]] = [
]


# ---- the graph ----------------------------------------------------------------

def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package_dir``."""
    root = package_dir.name
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (root, *path.relative_to(package_dir).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body)."""
    files = module_files(package_dir)
    root = package_dir.name
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]   # the package it is in
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from X import y`: the submodule X.y when there is one, else X
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source
                           for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] != root:
                    continue
                while t not in files:            # e.g. an extension module (_C): its package
                    t = t.rpartition(".")[0]
                if t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def runtime_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph plus, for an import of ``a.b.c``, the packages ``a.b`` (whose
    ``__init__`` runs first), leaving out the importer's own packages."""
    out = {}
    for name, edges in graph.items():
        own = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
        full = set(edges)
        for t in edges:
            parts = t.split(".")
            full.update(".".join(parts[:i]) for i in range(1, len(parts)))
        out[name] = {t for t in full if t in graph and t not in own}
    return out


# ---- the checks ---------------------------------------------------------------

def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component with more than one module,
    as a path ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in components:
        start = min(comp)
        # breadth-first from start back to start, inside the component
        prev: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v != start:
            path.append(v)
            v = prev[v]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index of the layer whose longest matching entry names ``module``. The
    root package's entry names only the root (its ``__init__``): a new module
    must be placed, not inherit the top layer."""
    best, best_len = None, -1
    for i, (_, entries) in enumerate(layers):
        for e in entries:
            inside = module.startswith(e + ".") and "." in e
            if (module == e or inside) and len(e) > best_len:
                best, best_len = i, len(e)
    return best


def upward_edges(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """Every edge whose target sits in a higher layer than its source (a module in
    no layer is test_every_module_has_a_layer's to report)."""
    def above(a, b):
        la, lb = layer_of(a, layers), layer_of(b, layers)
        return la is not None and lb is not None and lb > la
    return sorted((a, b) for a, edges in graph.items() for b in edges if above(a, b))


def describe(edge: tuple[str, str], layers=LAYERS) -> str:
    a, b = edge
    return f"{a} ({layers[layer_of(a, layers)][0]}) -> {b} ({layers[layer_of(b, layers)][0]})"


# ---- the tests on dllm_ops ------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE_DIR)


def test_graph_sees_known_edges(graph):
    """The parser finds module-level, function-local and relative imports."""
    assert "dllm_ops.packed_layout" in graph["dllm_ops.ops"]
    assert "dllm_ops.ops" in graph["dllm_ops.plan"]                    # from . import ops
    assert "dllm_ops.cli" in graph["dllm_ops.__main__"]
    assert "dllm_ops" in graph["dllm_ops.cli"]                         # import dllm_ops (local)
    assert "dllm_ops.quant.policy_table" in graph["dllm_ops.calibrate.select"]   # from ..quant.x


def without_known_exceptions(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {a: {b for b in edges if (a, b) not in KNOWN_EXCEPTIONS} for a, edges in graph.items()}


def test_no_import_cycle(graph):
    """Function-local imports count: a circle through one is still a circle
    (an edge of KNOWN_EXCEPTIONS is left out: it is known to go)."""
    cycles = find_cycles(runtime_edges(without_known_exceptions(graph)))
    assert not cycles, "import circles in dllm_ops: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_layer(graph):
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert not missing, f"modules in no layer of LAYERS (python_tests/test_imports.py): {missing}"


def test_no_import_goes_up_a_layer(graph):
    bad = [e for e in upward_edges(graph) if e not in KNOWN_EXCEPTIONS]
    assert not bad, ("imports from a higher layer (LAYERS in python_tests/test_imports.py):\n  "
                     + "\n  ".join(describe(e) for e in bad))


def test_known_exceptions_still_occur(graph):
    stale = [e for e in KNOWN_EXCEPTIONS if e not in upward_edges(graph)]
    assert not stale, f"these KNOWN_EXCEPTIONS no longer occur; delete them: {stale}"


# ---- the checker catches what it is for -----------------------------------------

def test_checker_on_a_synthetic_graph():
    layers = [("low", ["p.a", "p.b"]), ("high", ["p.c", "p"])]
    g = {"p": {"p.c"}, "p.a": {"p.b"}, "p.b": set(), "p.c": {"p.a"}}
    assert find_cycles(g) == [] and upward_edges(g, layers) == []
    g["p.b"] = {"p.c"}                                  # low -> high, and a circle a -> b -> c -> a
    assert upward_edges(g, layers) == [("p.b", "p.c")]
    assert find_cycles(g) == [["p.a", "p.b", "p.c", "p.a"]]


def _copy(tmp_path) -> Path:
    dst = tmp_path / "dllm_ops"
    shutil.copytree(PACKAGE_DIR, dst, ignore=lambda d, names: [
        n for n in names if not (n.endswith(".py") or os.path.isdir(os.path.join(d, n)))
        or n in ("__pycache__", "checkpoints")])
    return dst


def test_an_injected_upward_import_is_reported(tmp_path):
    """Against a copy of today's package (so it holds whatever the tree's own
    state): what the injection adds is exactly what is reported."""
    pkg = _copy(tmp_path)
    clean = import_graph(pkg)
    # a function-local import of the decode loop from the kernel layer: up, and a circle
    with open(pkg / "ops.py", "a") as f:
        f.write("\n\ndef _injected():\n    from .decode import generate\n    return generate\n")
    # a module-level relative import into another package: up, no circle
    with open(pkg / "models" / "config.py", "a") as f:
        f.write("\nfrom ..quant.bits import effective_bits  # noqa\n")
    g = import_graph(pkg)
    added = sorted(set(upward_edges(g)) - set(upward_edges(clean)))
    assert added == [("dllm_ops.models.config", "dllm_ops.quant.bits"),
                     ("dllm_ops.ops", "dllm_ops.decode")]
    assert describe(added[1]) == "dllm_ops.ops (kernels) -> dllm_ops.decode (decode)"

    def circled(graph):
        return [c for c in find_cycles(runtime_edges(without_known_exceptions(graph)))
                if "dllm_ops.ops" in c]
    assert circled(clean) == []
    assert len(circled(g)) == 1 and "dllm_ops.decode" in circled(g)[0]
