"""Layering rules of ``src/baton``, checked from the source with ``ast``.

The environment is read in ``baton/config.py`` only (``RuntimeEnv`` and the functions
beside it), so that one module lists every variable baton reads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "baton"

ENV_READER = "config.py"
"""The one module of ``src/baton`` that reads the environment."""
KNOWN_ENV_READS: dict[str, str] = {
    "transfer/worker.py": "its PD token read moves to config.read_secret_env with the PD "
    "engine refactor",
}
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
