"""The package's layers (DESIGN.md "Layers"): no module imports a higher layer, no import cycle.

Every module of costmodel/, piper_sim/, executor/ and calibration/ is parsed with `ast` (imports inside
functions count too) and mapped to its layer:

    app        piper_sim.cli (command line, demo, validation reports), piper_sim.__main__
    back ends  executor (replays a Plan), calibration (the calibration microbenchmarks)
    library    piper_sim (model specs, profiling, strategy, IR, compiler, plan, simulator, ...)
    bottom     costmodel

The one exception is the public facade ``piper_sim/__init__.py``: it may lazily reach any layer
(its lazy attributes name modules as strings, so no import statement shows it anyway).
"""

from __future__ import annotations

import ast
import os

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("costmodel", "piper_sim", "executor", "calibration")
LAYERS = ("bottom", "library", "back ends", "app")
FACADE = "piper_sim"


def layer(module: str) -> int:
    """The layer index of a module of ours (see the module docstring)."""
    top = module.split(".")[0]
    if module in ("piper_sim.cli", "piper_sim.__main__") or module.startswith("piper_sim.cli."):
        return 3
    return {"costmodel": 0, "piper_sim": 1, "executor": 2, "calibration": 2}[top]


def modules(root: str | None = None) -> dict[str, str]:
    """module name -> file, for every .py file of the packages (of this checkout by default)."""
    root = root or ROOT
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, f)
    return out


def imports(module: str, path: str, known: set[str]) -> set[str]:
    """The modules of ours that `module` imports anywhere in its file (`from pkg import sub` -> pkg.sub)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = os.path.basename(path) == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import piper_sim.models.x` -> the deepest module of ours
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def import_graph(root: str | None = None) -> nx.DiGraph:
    mods = modules(root)
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in mods.items():
        g.add_edges_from((mod, dep) for dep in imports(mod, path, set(mods)))
    return g


def test_the_walk_sees_every_layer_and_function_level_imports():
    g = import_graph()
    assert {layer(m) for m in g} == {0, 1, 2, 3}
    # compiler imports torch inside a function and costmodel at the top; the simulator reaches kineto lazily
    assert g.has_edge("piper_sim.compiler", "costmodel.hardware")
    assert g.has_edge("piper_sim.simulator", "piper_sim.kineto")  # an import inside a method


def test_no_module_imports_a_higher_layer():
    g = import_graph()
    upward = sorted(f"{a} ({LAYERS[layer(a)]}) -> {b} ({LAYERS[layer(b)]})" for a, b in g.edges
                    if a != FACADE and layer(b) > layer(a))
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_cycle():
    g = import_graph()
    g.remove_node(FACADE)  # the facade imports nothing by statement; submodules may import its version
    cycles = [c for c in nx.simple_cycles(g) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in sorted(cycles)[:20])


def test_the_costmodel_imports_nothing_of_ours():
    g = import_graph()
    out = sorted(f"{a} -> {b}" for a, b in g.edges if a.startswith("costmodel") and not b.startswith("costmodel"))
    assert not out, "\n".join(out)


def test_the_command_line_parser_and_facade_import_nothing_heavy():
    """`piper-sim --help` (every subcommand registered) and `import piper_sim` stay fast: the heavy
    libraries load only inside the commands that use them."""
    import subprocess
    import sys

    heavy = ("torch", "numpy", "pandas", "simpy", "matplotlib", "networkx", "tqdm", "yaml")
    code = (f"import sys, piper_sim, piper_sim.cli; piper_sim.cli.build_parser(); "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout.strip()
    assert out == "[]"


def test_a_cached_compile_imports_no_torch(tmp_path):
    """A compile whose profiles are all in the on-disk cache (a second `piper-sim compile` in a
    fresh process) never imports torch, and writes the plan the cold compile wrote."""
    import json
    import re
    import subprocess
    import sys

    strategy = tmp_path / "moe.json"  # every segment kind, TP (the whole model's flops) and selective recompute
    strategy.write_text(json.dumps({
        "model": "moe-tiny", "cluster": "cpu:8", "global_batch": 8, "seq_len": 32, "microbatches": 4,
        "directives": [{"op": "pipeline", "degree": 2}, {"op": "expert_parallel", "degree": 2},
                       {"op": "tensor_parallel", "degree": 2}, {"op": "recompute", "mode": "selective"}]}))
    code = ("import sys; from piper_sim.cli.commands import main; "
            f"rc = main(['compile', {str(strategy)!r}, '-o', {str(tmp_path / 'plan.json')!r}]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": ROOT, "PIPER_SIM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("PIPER_SIM_PROFILE_CACHE", None)

    def compile_once() -> tuple[str, bool]:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                             env=env).stdout
        return re.search(r"hash (\w+)", out).group(1), "torch imported: True" in out

    cold_hash, cold_torch = compile_once()
    assert cold_torch  # the cold compile profiled (the cache was empty)
    assert os.listdir(tmp_path / "cache" / "profiles")
    warm_hash, warm_torch = compile_once()
    assert not warm_torch, "a compile on a warm profile cache imported torch"
    assert warm_hash == cold_hash


def test_generic_modules_reach_the_techniques_only_through_the_registry():
    """`piper_sim.ir`, `strategy`, `directives`, `compiler` and `explore` reach `piper_sim.parallel.*`
    only through `piper_sim.axes` (issue 25: a technique is its module plus one registry line)."""
    g = import_graph()
    generic = ("piper_sim.ir", "piper_sim.strategy", "piper_sim.directives", "piper_sim.compiler", "piper_sim.explore")
    direct = sorted(f"{a} -> {b}" for a in generic for b in g.successors(a) if b.startswith("piper_sim.parallel"))
    assert not direct, "reach piper_sim.parallel through piper_sim.axes:\n" + "\n".join(direct)
    assert g.has_edge("piper_sim.compiler", "piper_sim.axes")


def test_generic_code_never_asks_which_axis_an_op_belongs_to():
    """No ``is_tp``/``is_cp`` (or a check of an op's stream name against an axis) outside the
    techniques' own modules: generic code asks `piper_sim.ir.is_inner`."""
    import re

    GENERIC_ROOTS = ("piper_sim/", "costmodel/", "executor/", "calibration/")
    allowed = ("piper_sim/parallel/", "executor/parallel/", "executor/tensor_parallel.py",
               "executor/context_parallel.py")
    pattern = re.compile(r"\bis_(tp|cp)\(|stream == \"(tp|cp)\"|\b(TP|CP)_STREAM\b")
    found = []
    for mod, path in modules().items():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel.startswith(allowed) or not rel.startswith(GENERIC_ROOTS):
            continue
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if pattern.search(line):
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "axis checks in generic code:\n" + "\n".join(found)
