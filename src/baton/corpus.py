"""The bundled model's text: the running interpreter's standard library sources.

One place for the file list and the held-out split, shared by the training script, the
benchmarks and the tests, so that "held-out code" means the same files everywhere.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

MAX_FILE_BYTES = 256 * 1024  # a few generated tables dwarf everything else; skip them


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib ``.py`` file, sorted, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or "__pycache__" in rel:
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append((rel, path))
    return files


def is_held_out(rel: str) -> bool:
    """About 2% of files, chosen by a hash of the path: never trained on."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0


def read_sources(files: list[tuple[str, Path]]) -> list[str]:
    texts = []
    for _, path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def held_out_texts() -> list[str]:
    return read_sources([f for f in stdlib_files() if is_held_out(f[0])])
