"""The package layering of ``src/baton``, checked from the source with ``ast``.

Every ``.py`` file belongs to a *unit*: the first component of its path under ``baton`` -- a
subpackage (``engine``, ``memory``, ...) or a top-level module (``tokenizer``, ``config``,
...); ``baton/__init__.py`` is the unit ``baton``. Every import of ``baton.X...`` counts,
at module level or inside a function, ``if TYPE_CHECKING:`` blocks included (a type-only
import is still a dependency of the reader). The layers, lowest first; a unit may import
its own layer and the ones below it, never one above::

    config, cores, sampling_params, request, platform, tokenizer, detokenizer    (base)
    kernels
    memory
    model
    sampling
    speculative
    engine
    transfer
    server
    router
    cli, cli_args, cli_serve, launch

Units the list does not name (``bench``, ``corpus``, ``supervisor``, ``baton``) are held
only to the no-cycle rule.

The environment is read in ``baton/config.py`` only (``RuntimeEnv`` and the functions
beside it), so that one module lists every variable baton reads.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "baton"

LAYERS: list[set[str]] = [
    {"config", "cores", "sampling_params", "request", "platform", "tokenizer", "detokenizer"},
    {"kernels"},
    {"memory"},
    {"model"},
    {"sampling"},
    {"speculative"},
    {"engine"},
    {"transfer"},
    {"server"},
    {"router"},
    {"cli", "cli_args", "cli_serve", "launch"},
    {"integrations"},
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Cycles being removed elsewhere: the unit set -> why it is tolerated for now."""

Edge = tuple[str, str]
Site = tuple[str, int]  # (file relative to src/, line)


def _units() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in SRC.iterdir() if _is_unit(p)}


def _is_unit(path: Path) -> bool:
    if path.is_dir():
        return (path / "__init__.py").is_file()
    return path.suffix == ".py" and path.name != "__init__.py"


def _unit_of_file(path: Path) -> str:
    rel = path.relative_to(SRC)
    if rel.parts == ("__init__.py",):
        return "baton"
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _package_of_file(path: Path) -> list[str]:
    """The dotted package a file's relative imports start from, as components."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return parts[:-1]  # a module's package; ``pkg/__init__`` -> ``pkg`` as well


def _imported_units(node: ast.AST, path: Path, units: set[str]) -> list[str]:
    """The baton units one import statement reaches."""
    if isinstance(node, ast.Import):
        modules = [alias.name.split(".") for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module.split(".") if node.module else []
        if node.level:
            package = _package_of_file(path)
            base = package[: len(package) - (node.level - 1)] + base
        if base == ["baton"]:
            # ``from baton import platform`` imports the unit; ``from baton import LLM`` the root
            return [a.name if a.name in units else "baton" for a in node.names]
        modules = [base]
    else:
        return []
    found = []
    for parts in modules:
        if parts[:1] == ["baton"]:
            found.append(parts[1] if len(parts) > 1 else "baton")
    return found


def import_graph() -> dict[Edge, list[Site]]:
    """(importer unit, imported unit) -> every file:line that makes that edge."""
    units = _units()
    edges: dict[Edge, list[Site]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        source = _unit_of_file(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported_units(node, path, units):
                where = (str(path.relative_to(SRC.parent)), node.lineno)
                if target != source and where not in edges[(source, target)]:
                    edges[(source, target)].append(where)
    return dict(edges)


def _cycles(edges: dict[Edge, list[Site]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycle_path(component: list[str], edges: dict[Edge, list[Site]]) -> list[str]:
    """One closed walk through a strongly connected component: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    # Breadth-first from ``start`` back to itself inside the component.
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for a in frontier:
            for b in sorted(b for (x, b) in edges if x == a and b in members):
                if b == start:
                    path = [start]
                    while a != start:
                        path.append(a)
                        a = parent[a]
                    return [start, *reversed(path[1:]), start]
                if b not in parent:
                    parent[b] = a
                    nxt.append(b)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def _describe(path: list[str], edges: dict[Edge, list[Site]]) -> str:
    lines = [" -> ".join(path)]
    for a, b in zip(path, path[1:], strict=False):
        sites = ", ".join(f"{f}:{n}" for f, n in edges[(a, b)])
        lines.append(f"  {a} -> {b}: {sites}")
    return "\n".join(lines)


def test_no_import_cycle_between_packages():
    edges = import_graph()
    assert edges, "found no baton imports at all: is SRC right?"
    cycles = _cycles(edges)
    known = [c for c in cycles if frozenset(c) in KNOWN_CYCLES]
    unknown = [c for c in cycles if frozenset(c) not in KNOWN_CYCLES]
    assert not unknown, "import cycles between baton units:\n" + "\n".join(
        _describe(_cycle_path(c, edges), edges) for c in unknown
    )
    if known:
        pytest.xfail(
            "; ".join(
                f"{KNOWN_CYCLES[frozenset(c)]}: {' -> '.join(_cycle_path(c, edges))}" for c in known
            )
        )


def test_imports_and_cycles_are_found():
    units = {"engine", "model", "platform", "sampling"}
    source = """from baton.model.spec import ModelSpec
from baton import platform, LLM
from . import runner
from ..sampling import sampler
import baton.model, os
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from baton.sampling.sampler import Sampler
def f():
    import baton.platform
"""
    path = SRC / "engine" / "example.py"
    found = [
        (node.lineno, unit)
        for node in ast.walk(ast.parse(source))
        for unit in _imported_units(node, path, units)
    ]
    assert sorted(found) == [
        (1, "model"),
        (2, "baton"),
        (2, "platform"),
        (3, "engine"),
        (4, "sampling"),
        (5, "model"),
        (8, "sampling"),
        (10, "platform"),
    ]
    edges = {("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): [], ("d", "e"): []}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycle_path(["a", "b", "c"], edges) == ["a", "b", "c", "a"]


def test_layers_import_only_downwards():
    edges = import_graph()
    tolerated = {(a, b) for cycle in KNOWN_CYCLES for a in cycle for b in cycle if (a, b) in edges}
    upward = {
        (a, b): sites
        for (a, b), sites in edges.items()
        if a in LAYER_OF and b in LAYER_OF and LAYER_OF[a] < LAYER_OF[b]
    }
    violations = [
        f"{f}:{n}: {a} (layer {LAYER_OF[a]}) imports {b} (layer {LAYER_OF[b]})"
        for (a, b), sites in sorted(upward.items())
        if (a, b) not in tolerated
        for f, n in sites
    ]
    assert not violations, "a lower layer imports a higher one:\n" + "\n".join(violations)
    known = sorted(set(upward) & tolerated)
    if known:
        pytest.xfail(
            "upward imports of a known cycle: "
            + "; ".join(f"{a} -> {b} ({edges[(a, b)][0][0]})" for a, b in known)
        )


ENV_READER = "config.py"
"""The one module of ``src/baton`` that reads the environment."""
KNOWN_ENV_READS: dict[str, str] = {}
"""Files (relative to ``src/baton``) still reading the environment -> why it is tolerated."""
_ENVIRON_WRITES = {"setdefault", "pop", "update", "clear", "copy"}
"""``os.environ`` methods that set it, or copy it for a child process: not reads."""


def _is_os_attr(node: ast.AST, names: set[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in names
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read the environment: ``os.getenv(...)``, ``os.environ.get(...)`` (any
    method but a write or a copy), ``os.environ[...]`` as a value, ``... in os.environ``,
    and ``from os import environ`` / ``getenv``. ``os.environ[k] = v`` and ``{**os.environ, ...}``
    (a child's environment) are not reads."""
    environ = {"environ", "environb"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_os_attr(node.func, {"getenv", "getenvb"}):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and _is_os_attr(node.value, environ):
            if node.attr not in _ENVIRON_WRITES:
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_os_attr(node.value, environ):
            if isinstance(node.ctx, ast.Load):
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn) and _is_os_attr(right, environ):
                    lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno] if {a.name for a in node.names} & (environ | {"getenv"}) else []
    return sorted(set(lines))


def test_environment_is_read_in_config_only():
    reads: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == ENV_READER:
            continue
        source = path.read_text()
        found = _environment_reads(ast.parse(source, filename=str(path)))
        text = source.splitlines()
        reads[rel] = [f"src/baton/{rel}:{n}: {text[n - 1].strip()}" for n in found]
    stale = [rel for rel in KNOWN_ENV_READS if not reads.get(rel)]
    assert not stale, f"KNOWN_ENV_READS names files that read no environment any more: {stale}"
    unknown = [site for rel, sites in reads.items() if rel not in KNOWN_ENV_READS for site in sites]
    assert not unknown, (
        "the environment is read outside baton/config.py (read it through RuntimeEnv or a "
        "function there):\n" + "\n".join(unknown)
    )
    if KNOWN_ENV_READS:
        pytest.xfail("; ".join(f"{rel}: {why}" for rel, why in KNOWN_ENV_READS.items()))


def test_environment_reads_are_found():
    source = """import os
a = os.environ.get("A")
b = os.getenv("B")
c = os.environ["C"]
d = "D" in os.environ
from os import environ
os.environ["E"] = "1"
os.environ.setdefault("F", "1")
child = {**os.environ, "G": "1"}
"""
    assert _environment_reads(ast.parse(source)) == [2, 3, 4, 5, 6]


# -- the engine's internals stay in engine/ -------------------------------------------------
ENGINE_INTERNALS = re.compile(
    r"\bengine\._\w+|\bscheduler\.(running|waiting)\b|\bengine\.tracks\b|\b_Track\b"
    r"|\bengine\.scheduler\.(add|finish|abort|add_running)\b"
)
"""A private attribute of an engine, its scheduler's queues or transitions, its tracks."""


def _engine_internal_uses(root: Path) -> list[str]:
    sites = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("engine/"):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#", 1)[0]
            if ENGINE_INTERNALS.search(code):
                sites.append(f"{rel}:{lineno}: {line.strip()}")
    return sites


def test_no_module_outside_engine_touches_its_internals():
    """The engine owns every request's lifecycle: outside ``engine/`` only its public API
    (``add_request``, ``step``, ``abort_request``, ``handoff``, ``stats``, ...) is used."""
    sites = _engine_internal_uses(SRC)
    assert not sites, "engine internals used outside baton/engine/:\n" + "\n".join(sites)


def test_engine_internal_uses_are_found(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "engine.py").write_text("self.engine._ids = 1\n")
    (tmp_path / "transfer.py").write_text(
        "x = engine._new_track(p)\n"
        "engine.scheduler.running.append(r)\n"
        "n = len(self.engine.tracks)  # a comment: engine._x\n"
        "y = engine.handoff.admit(r)\n"
    )
    found = _engine_internal_uses(tmp_path)
    assert [site.split(":")[1] for site in found] == ["1", "2", "3"], found


# -- no circle between two files, inside a package or across ---------------------------------
def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts)


def file_import_graph() -> dict[Edge, list[Site]]:
    """(importer module, imported module) -> file:line, over the files that are not a
    package's ``__init__`` (which re-export what their modules define: not a dependency of
    those modules' design)."""
    modules = {_module_of(p) for p in SRC.rglob("*.py") if p.name != "__init__.py"}
    edges: dict[Edge, list[Site]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        source = _module_of(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != source:
                    edges[(source, target)].append((str(path.relative_to(SRC.parent)), node.lineno))
    return dict(edges)


def test_no_import_circle_between_files():
    """Issue 41: five two-file circles (a class cut into files by line count, each half
    importing the other) made ``self._x`` a search through three files. Every import
    counts, ``TYPE_CHECKING`` ones too."""
    edges = file_import_graph()
    assert len(edges) > 100, "found few imports between files: is SRC right?"
    cycles = _cycles(edges)
    assert not cycles, "import circles between files:\n" + "\n".join(
        _describe(_cycle_path(c, edges), edges) for c in cycles
    )


def test_router_and_cli_do_not_load_torch():
    """The router keeps no model state: importing it (or the CLI's entry point) must not load
    torch, which took the router process from 60 to 250 MB (it came in through a package
    ``__init__`` that imported the transfer planner)."""
    import subprocess
    import sys

    heavy = "('torch', 'numpy', 'transformers')"
    code = (
        "import sys, baton.router.router, baton.cli, baton.launch, baton.supervisor; "
        f"print(sorted(m for m in {heavy} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout


# -- no private name of another file's object ------------------------------------------------
def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses_across_files(root: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` / ``cls`` and ``_name`` is one baton defines
    (a ``def _name`` or a ``self._name =``) only in other files: a file reaching into an
    object of another's. Library privates (``torch._C``, ``os._exit``) are not baton's."""
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in sorted(root.rglob("*.py"))}
    owners: dict[str, set[Path]] = defaultdict(set)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(node.name):
                owners[node.name].add(path)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
                and _is_private(node.attr)
            ):
                owners[node.attr].add(path)
    sites = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if owners.get(node.attr) and path not in owners[node.attr]:
                sites.append((path.relative_to(root), node.lineno, ast.unparse(node)))
    return [f"{path}:{line}: {use}" for path, line, use in sorted(sites)]


def test_no_file_uses_another_files_private_names():
    sites = private_uses_across_files(SRC)
    assert not sites, "private names of another file's objects:\n" + "\n".join(sites)


def test_private_uses_across_files_are_found(tmp_path):
    (tmp_path / "pool.py").write_text(
        "class Pool:\n"
        "    def _slots(self): ...\n"
        "    def __init__(self):\n        self._rows = 1\n"
        "    def take(self, other):\n        return other._slots(), self._rows\n"
    )
    (tmp_path / "model.py").write_text(
        "def f(pool, torch):\n"
        "    a = pool._slots()\n"
        "    b = pool.owner._rows\n"
        "    return torch._C, pool.__class__\n"
    )
    found = private_uses_across_files(tmp_path)
    assert found == ["model.py:2: pool._slots", "model.py:3: pool.owner._rows"], found
