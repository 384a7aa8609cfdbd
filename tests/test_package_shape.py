"""The shape of the two packages, read from their source (nothing is imported):

- no import circle among the modules of `longspec_cli/` and `longspec/`;
- no module over 450 lines (bench/'s scripts too);
- thin verbs: no function of `longspec_cli/commands/` does more than about 45 lines of work;
- one owner of the trainer modules' command lines (`longspec_cli/launch/trainer.py`).

Both module-level imports and imports inside functions count: a function-level import still makes
the two modules depend on each other, it only moves the failure from import time to call time.
Imports under `if TYPE_CHECKING:` count too (they are the same dependency for a reader).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("longspec_cli", "longspec")
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The package module `name` stands for (a name imported from a module is the module)."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (itself and its own parent packages left out)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" for a in node.names] or [stem]
            for t in targets:
                dep = _resolve(t, mods)
                if dep is not None and dep != mod and not mod.startswith(dep + "."):
                    graph[mod].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module, each as one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is small, recursion is fine
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(g, graph) for g in groups]


def _circle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    prev: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return group


def test_no_import_circle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_finds_a_circle_when_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_imports():
    graph = import_graph()
    # launch/preflight.py imports launch/disk.py inside a function
    assert "longspec_cli.launch.disk" in graph["longspec_cli.launch.preflight"]


def over_limit(limit: int = MAX_LINES) -> dict[str, int]:
    """'pkg/file.py' -> line count, for every package module (and bench/ script) over `limit` lines."""
    out = {}
    for path in [*_modules().values(), *sorted((ROOT / "bench").glob("*.py"))]:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out[path.relative_to(ROOT).as_posix()] = n
    return out


def test_no_module_over_450_lines():
    over = over_limit()
    assert not over, "modules over 450 lines (split them by job): " + ", ".join(
        f"{f} ({n})" for f, n in sorted(over.items()))


def test_the_line_rule_reads_bench_too():
    assert any(p.parent.name == "bench" for p in [ROOT / f for f in over_limit(10)])


# ----------------------------------------------------------------------------- thin verbs

MAX_VERB_LINES = 45


def long_functions(folder: Path, limit: int = MAX_VERB_LINES, root: Path = ROOT) -> dict[str, int]:
    """'file.py:line name' -> lines of work, for every function under `folder` that does more than
    `limit` lines of it: its body from the first statement to the last, the docstring left out (a
    Typer verb's signature is its parsing, declared; the body is what it does)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            n = body[-1].end_lineno - body[0].lineno + 1 if body else 0
            if n > limit:
                out[f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name}"] = n
    return out


def test_every_verb_is_thin():
    """A verb parses, calls one library or launch function and renders: the work lives in launch/ or
    the library, where the other front ends (the TUI, `run`, `demo`) reach it too."""
    long = long_functions(ROOT / "longspec_cli" / "commands")
    assert not long, f"verbs over {MAX_VERB_LINES} lines of work (move the work to launch/ or the library): " + \
        ", ".join(f"{f} ({n})" for f, n in sorted(long.items()))


def test_the_verb_rule_counts_the_body(tmp_path):
    """The signature and the docstring do not count; every line from the first statement on does."""
    (tmp_path / "v.py").write_text('def f(\n    a=1,\n    b=2,\n):\n    """Doc."""\n    x = a\n\n    return x + b\n')
    assert long_functions(tmp_path, 2, tmp_path) == {"v.py:1 f": 3}
    assert long_functions(tmp_path, 3, tmp_path) == {}


# ----------------------------------------------------------------------------- one owner of the trainer's lines

LINE_OWNER = "longspec_cli/launch/trainer.py"
STARTED = {"train", "prepare", "show", "evaluate", "export", "regenerate", "doctor", "draftcheck"}


def module_lines_outside_owner() -> list[str]:
    """Where a module name the front end starts ('longspec.evaluate', ...) is written as a string
    outside the owner, in the front end or the library's ground floor (the library's runnable
    modules name themselves in their own help and messages)."""
    names = {f"longspec.{m}" for m in STARTED}
    out = []
    paths = sorted((ROOT / "longspec_cli").rglob("*.py")) + [
        p for g in PURE for p in sorted((ROOT / g.replace(".", "/")).rglob("*.py"))
        if (ROOT / g.replace(".", "/")).is_dir()]
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        if rel == LINE_OWNER:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                out.append(f"{rel}:{node.lineno} {node.value!r}")
    return out


def test_one_owner_builds_the_trainer_modules_command_lines():
    found = module_lines_outside_owner()
    assert not found, f"trainer module names outside {LINE_OWNER} (build the line there):\n  " + "\n  ".join(found)


# ----------------------------------------------------------------------------- the trainer's layers

# The library's torch-free groups are its ground floor: the front end imports them (and nothing else
# of the library), the trainer's groups build on them. They may use one another (no module circle).
PURE = ("longspec.errors", "longspec.files", "longspec.machine", "longspec.formats", "longspec.project",
        "longspec.runs")
# Each group of the trainer imports only the groups below it and the ground floor; the modules people
# run (`python -m longspec.train`, ...) sit on top and may use any group, never one another.
LAYERS = {
    **{g: set(PURE) - {g} for g in PURE},
    "longspec.model": {*PURE},
    "longspec.data": {*PURE},
    "longspec.decode": {*PURE, "longspec.model"},
    "longspec.measure": {*PURE, "longspec.model", "longspec.data", "longspec.decode"},
    "longspec.training": {*PURE, "longspec.model", "longspec.data", "longspec.decode", "longspec.measure"},
    "longspec.serve": {*PURE},     # runs inside vLLM's environment: vLLM, its torch and the ground floor
}
RUNNABLE = {"train", "prepare", "show", "evaluate", "export", "draftcheck", "tiny", "nodelaunch", "nodectl", "regenerate",
            "doctor"}


def _group(mod: str) -> str | None:
    """The trainer group a module belongs to ('longspec.model'), 'longspec' for a top module, else None."""
    parts = mod.split(".")
    if parts[0] != "longspec" or len(parts) == 1:
        return None
    return ".".join(parts[:2]) if len(parts) > 2 or f"longspec.{parts[1]}" in LAYERS else "longspec"


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        group = _group(mod)
        for dep in sorted(deps):
            dgroup = _group(dep)
            if group is None or dgroup is None or dgroup == group and group != "longspec":
                continue
            if group == "longspec":
                if dgroup == "longspec":
                    out.append(f"{mod} -> {dep} (a module people run imports another)")
            elif dgroup == "longspec" or dgroup not in LAYERS[group]:
                above = sorted(LAYERS[group] - set(PURE))
                out.append(f"{mod} -> {dep} ({group} may import only the ground floor"
                           + (f" and {above})" if above else ")"))
    return out


def test_trainer_groups_import_only_the_layers_below():
    graph = import_graph()
    groups = {m.rsplit(".", 1)[0] for m in graph if m.count(".") == 2 and m.startswith("longspec.")}
    assert groups | {"longspec.errors"} == set(LAYERS), "a library group is missing from the layer map"
    tops = {m for m in graph if m.count(".") == 1 and m.startswith("longspec.")} - set(LAYERS)
    assert tops == {f"longspec.{m}" for m in RUNNABLE}, "the trainer's top holds the modules people run, no others"
    breaches = layer_breaches(graph)
    assert not breaches, "imports against the layers:\n  " + "\n  ".join(breaches)


def test_layer_check_sees_an_upward_import():
    graph = {"longspec.model.glide": {"longspec.data.encoding"}, "longspec.data.encoding": set(),
             "longspec.training.simtau": {"longspec.evaluate"}, "longspec.evaluate": set(),
             "longspec.export": {"longspec.evaluate"}, "longspec.measure.prompts": {"longspec.data.chat"},
             "longspec.data.chat": set()}
    assert layer_breaches(graph) == [
        "longspec.export -> longspec.evaluate (a module people run imports another)",
        "longspec.model.glide -> longspec.data.encoding (longspec.model may import only the ground floor)",
        "longspec.training.simtau -> longspec.evaluate (longspec.training may import only the ground floor and "
        "['longspec.data', 'longspec.decode', 'longspec.measure', 'longspec.model'])",
    ]


def test_every_package_face_is_a_docstring_alone():
    """`import longspec.training.preempt` (nodelaunch) must not load torch through a package face,
    and each group's face names every file of the group."""
    for group in set(LAYERS) - {"longspec.errors"}:
        folder = ROOT / group.replace(".", "/")
        tree = ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree)
        assert doc and len(tree.body) == 1, f"{group}: its __init__.py is a docstring and nothing else"
        missing = [p.name for p in sorted(folder.glob("*.py")) if p.name != "__init__.py" and p.name not in doc]
        assert not missing, f"{group}'s docstring does not name {missing}"


# ----------------------------------------------------------------------------- the two packages

def direction_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the one direction, front end -> library: the library imports nothing of the
    front end, and the front end takes only the library's torch-free ground floor (the trainer's
    torch modules it starts as processes)."""
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if mod.startswith("longspec.") and dep.split(".")[0] == "longspec_cli":
                out.append(f"{mod} -> {dep} (the library imports the front end)")
            elif mod.split(".")[0] == "longspec_cli" and dep.startswith("longspec.") and not any(
                    dep == g or dep.startswith(g + ".") for g in PURE):
                out.append(f"{mod} -> {dep} (the front end imports the trainer, not the ground floor)")
    return out


def test_imports_run_one_way_front_end_to_library():
    breaches = direction_breaches(import_graph())
    assert not breaches, "imports against the direction:\n  " + "\n  ".join(breaches)


def test_direction_check_sees_both_wrong_ways():
    graph = {"longspec.runs.status": {"longspec_cli.launch.chain"}, "longspec_cli.commands.eval": {
        "longspec.evaluate", "longspec.runs.status"}, "longspec.evaluate": set(), "longspec_cli.launch.chain": set()}
    assert direction_breaches(graph) == [
        "longspec.runs.status -> longspec_cli.launch.chain (the library imports the front end)",
        "longspec_cli.commands.eval -> longspec.evaluate (the front end imports the trainer, not the ground floor)",
    ]


def test_the_ground_floor_loads_no_heavy_library():
    """Every module of the torch-free groups imports (in a fresh process) without torch, deepspeed,
    transformers or textual."""
    import json
    import subprocess
    import sys

    mods = sorted(m for m in _modules() if any(m == g or m.startswith(g + ".") for g in PURE))
    assert len(mods) > 30
    probe = "\n".join(f"import {m}" for m in mods) + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("torch", "deepspeed", "transformers", "textual"))
    assert heavy == []
