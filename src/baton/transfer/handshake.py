"""The pairing rules: who may hand state to whom (docs/design.md principle 3).

This module owns (a) building a worker's own ``Hello`` from its engine and model directory
and (b) ``check_pairing``, the one place that decides whether a prefill and a decode worker
are compatible. Both sides call ``check_pairing(local, remote)`` on the peer's ``Hello`` /
``HelloAck`` before any ``ReserveState``; a refusal is a ``PairingError`` that lists *every*
difference, each naming the component and the field with both sides' values, so a forgotten
pool (``draft.swa`` declared on one side only) is an error at bootstrap, not a silent drop in
acceptance length later. It sends nothing (``channel.py``) and never touches pools.

One difference is not refused: the page size of a paged component (``page_size``, the
page dimension of ``unit_shape`` and so ``unit_bytes``), which the transfer plan translates
token by token (``plan.plan_tokens``); everything else about the component -- kind,
layers, dtype, heads, head dim, window, token lag -- must be equal. Pool sizes are no part
of the schema: each side sizes its own.

Model identity is cheap by design: config files are hashed, weight files only by name and
size (hashing gigabytes of weights at every bootstrap is not worth it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

from baton.config import EngineConfig
from baton.memory import kv_format
from baton.transfer.protocol import PROTOCOL_VERSION, Hello, PeerInfo, Role, SpeculativeConfig

CONFIG_FILE = "config.json"
DRAFT_CONFIG_FILE = "mtp_config.json"  # NOTE: same name as baton.model.draft (no torch here)
DEFAULT_DRAFT_WEIGHTS = "mtp.safetensors"
MAX_VALUE_CHARS = 120
"""Values longer than this are shortened in error messages."""


class PairingError(ValueError):
    """Two workers cannot pair; ``problems`` lists each difference in words."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


class RegistryLike(Protocol):
    def schema(self) -> list[dict[str, Any]]: ...


class EngineLike(Protocol):
    """What ``build_hello`` reads from an engine (``LLMEngine`` satisfies it)."""

    registry: RegistryLike
    config: EngineConfig
    quantization: str | None  # the weights' (``--quantization`` or the checkpoint's)
    weights_held_once: bool  # bf16 weights in linear.c's panels alone (``--weight-copies 1``)


# -- identities ------------------------------------------------------------------------------
def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weight_sizes(model_dir: Path, names: list[str]) -> dict[str, int]:
    sizes = {}
    for name in names:
        path = model_dir / name
        if not path.is_file():
            raise ValueError(f"{model_dir}: weight file {name} not found")
        sizes[name] = path.stat().st_size
    return sizes


def model_identity(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The target model's identity: architecture, sha256 of ``config.json``, weight file
    names and sizes (``model.safetensors`` or the shards of its index); ``build_hello``
    adds the engine's weight quantization."""
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{model_dir}: {CONFIG_FILE} not found")
    config = json.loads(config_path.read_text())
    if (model_dir / "model.safetensors").is_file():
        names = ["model.safetensors"]
    elif (model_dir / "model.safetensors.index.json").is_file():
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        names = sorted(set(index["weight_map"].values()))
    else:
        raise ValueError(f"{model_dir}: neither model.safetensors nor its index")
    return {
        "architecture": ",".join(config.get("architectures") or []),
        "config_sha256": _sha256_file(config_path),
        "weight_files": _weight_sizes(model_dir, names),
    }


def draft_identity(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The MTP draft's identity (sha256 of ``mtp_config.json``, its weight file name and
    size), or None when the directory has no draft."""
    model_dir = Path(model_dir)
    config_path = model_dir / DRAFT_CONFIG_FILE
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    weights = config.get("weights_file", DEFAULT_DRAFT_WEIGHTS)
    return {
        "architecture": config.get("architecture", ""),
        "config_sha256": _sha256_file(config_path),
        "weight_files": _weight_sizes(model_dir, [weights]),
    }


def schema_hash(schema: list[dict[str, Any]]) -> str:
    """sha256 of a schema, computed exactly as ``StateRegistry.schema_hash``."""
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def build_hello(
    engine: EngineLike,
    model_dir: str | os.PathLike,
    *,
    worker_id: str,
    role: Role,
    backend: str,
    regions: dict[str, dict[str, Any]] | None = None,
) -> Hello:
    """This worker's declaration. Speculation is on exactly when the engine loads a draft:
    ``config.speculative`` is not False, its method is ``mtp`` and the directory has
    ``mtp_config.json``. (N-gram speculation is the decode worker's own: it reads the
    request's tokens, which both sides have, so a pair need not agree on it.)"""
    config = engine.config
    uses_draft = config.speculative is not False and config.speculative_method == "mtp"
    draft = draft_identity(model_dir) if uses_draft else None
    schema = engine.registry.schema()
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        worker_id=worker_id,
        role=role,
        # the weights decode computes with: quantized ones give other keys, values and tokens
        # and how: held once, the matmuls' epilogues round as F.linear's (other bits)
        model={
            **model_identity(model_dir),
            "quantization": engine.quantization or "none",
            "weight_copies": 1 if engine.weights_held_once else 2,
        },
        draft=draft,
        speculative=SpeculativeConfig(
            enabled=draft is not None,
            num_speculative_tokens=engine.num_speculative_tokens if draft is not None else 0,
        ),
        schema=schema,
        schema_hash=schema_hash(schema),
        backend=backend,
        regions=regions or {},
        pid=os.getpid(),
        host_id=host_id(),
    )


def host_id() -> str:
    """This host's boot id and pid namespace (``""`` where Linux's /proc is absent): two
    workers with the same value see the same process ids, so one can watch the other exit."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/pidns:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


# -- pairing ---------------------------------------------------------------------------------
def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


class _Sides:
    """Names the two sides in messages: by role, or local/remote if the roles clash."""

    def __init__(self, local: PeerInfo, remote: PeerInfo) -> None:
        distinct = local.role != remote.role
        self.local = local.role if distinct else "local"
        self.remote = remote.role if distinct else "remote"

    def differs(self, what: str, field: str, local: Any, remote: Any) -> str:
        return f"{what}{field} differs ({self.local} {_show(local)}, {self.remote} {_show(remote)})"


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


MODEL_FIXES = {
    "weight_copies": "start both with the same --weight-copies (baton launch decides it "
    "once for all its workers)",
}
"""Model identity fields a user sets, and how to make a pair agree on them."""


def _compare_dicts(
    sides: _Sides, what: str, local: dict, remote: dict, fixes: dict[str, str] | None = None
) -> list[str]:
    """A line per field that differs, with its ``fixes`` entry where there is one."""
    keys = [*local, *(k for k in remote if k not in local)]
    fixes = fixes or {}
    return [
        sides.differs(what, k, local.get(k, _MISSING), remote.get(k, _MISSING))
        + (f": {fixes[k]}" if k in fixes else "")
        for k in keys
        if local.get(k, _MISSING) != remote.get(k, _MISSING)
    ]


def _by_name(sides: str, schema: list[dict[str, Any]], problems: list[str]) -> dict[str, dict]:
    components: dict[str, dict] = {}
    for component in schema:
        name = component.get("name")
        if not isinstance(name, str):
            problems.append(f"{sides} declares a component without a name: {_show(component)}")
        elif name in components:
            problems.append(f"{sides} declares component `{name}` twice")
        else:
            components[name] = component
    return components


PAGE_DIM = 2
"""Index of the page dimension in a paged unit's shape [num_layers, 2 (k/v), page_size,
num_kv_heads, head_dim]."""
PAGE_FIELDS = frozenset({"page_size", "unit_bytes", "unit_shape"})
"""The fields a page-size difference changes."""


def page_size_differs(local: dict[str, Any], remote: dict[str, Any]) -> bool:
    """Whether two declarations of one component differ only in a page size the transfer
    plan translates: both paged with k/v planes, every other field and dimension equal, the
    same bytes per token."""
    shapes = local.get("unit_shape"), remote.get("unit_shape")
    sizes = local.get("page_size"), remote.get("page_size")
    if local.get("unit") != "page" or remote.get("unit") != "page" or sizes[0] == sizes[1]:
        return False
    if not all(isinstance(s, list) and len(s) == 5 and s[1] == 2 for s in shapes):
        return False
    pairs = zip(shapes, sizes, strict=True)
    if not all(isinstance(n, int) and n > 0 and s[PAGE_DIM] == n for s, n in pairs):
        return False
    page_free = [s[:PAGE_DIM] + s[PAGE_DIM + 1 :] for s in shapes]
    same_bytes = local.get("unit_bytes", 0) * sizes[1] == remote.get("unit_bytes", 0) * sizes[0]
    others = (local.keys() | remote.keys()) - PAGE_FIELDS
    return (
        page_free[0] == page_free[1]
        and same_bytes
        and all(local.get(k, _MISSING) == remote.get(k, _MISSING) for k in others)
    )


def schema_problems(local: PeerInfo, remote: PeerInfo) -> list[str]:
    """Every difference between the two state schemas, component by component, except a
    page size the transfer plan translates (``page_size_differs``); equal schemas (their
    hashes) are the fast path."""
    sides = _Sides(local, remote)
    problems = []
    for side, info in ((sides.local, local), (sides.remote, remote)):
        if info.schema_hash != schema_hash(info.schema):
            problems.append(f"{side}'s schema_hash does not match its own schema")
    if schema_hash(local.schema) == schema_hash(remote.schema):
        return problems  # the cheap check: equal canonical schemas
    mine = _by_name(sides.local, local.schema, problems)
    theirs = _by_name(sides.remote, remote.schema, problems)
    for name in sorted(mine.keys() - theirs.keys()):
        problems.append(f"{sides.local} expects `{name}`, {sides.remote} does not declare it")
    for name in sorted(theirs.keys() - mine.keys()):
        problems.append(f"{sides.remote} expects `{name}`, {sides.local} does not declare it")
    translated = 0
    for name in sorted(mine.keys() & theirs.keys()):
        if page_size_differs(mine[name], theirs[name]):
            translated += 1  # the plan moves it token by token
        else:
            problems += _compare_dicts(sides, f"component `{name}`: ", mine[name], theirs[name])
    if not problems and not translated:  # same content, other order or encoding: not equal
        problems.append("schemas differ in component order though no field differs")
    return problems


def pairing_problems(local: PeerInfo, remote: PeerInfo) -> list[str]:
    """Every reason ``local`` and ``remote`` cannot pair; empty when they can."""
    sides = _Sides(local, remote)
    problems = []
    if local.protocol_version != remote.protocol_version:
        problems.append(
            sides.differs("", "protocol version", local.protocol_version, remote.protocol_version)
        )
    if {local.role, remote.role} != {"prefill", "decode"}:
        problems.append(f"a pair is one prefill and one decode, got {local.role} and {remote.role}")
    problems += _compare_dicts(sides, "model identity: ", local.model, remote.model, MODEL_FIXES)
    if (local.draft is None) != (remote.draft is None):
        has, lacks = (sides.local, sides.remote) if local.draft else (sides.remote, sides.local)
        problems.append(f"{has} uses a draft model, {lacks} has none")
    elif local.draft is not None and remote.draft is not None:
        problems += _compare_dicts(sides, "draft identity: ", local.draft, remote.draft)
    for field in ("enabled", "num_speculative_tokens"):
        mine, theirs = getattr(local.speculative, field), getattr(remote.speculative, field)
        if mine != theirs:
            hint = ""
            if field == "num_speculative_tokens":
                hint = (
                    ": start both with the same --num-speculative-tokens (unset, it follows "
                    "the compute dtype: 4 in bfloat16, 3 in float32)"
                )
            problems.append(sides.differs("speculative config: ", field, mine, theirs) + hint)
    if local.backend != remote.backend:
        problems.append(sides.differs("", "transfer backend", local.backend, remote.backend))
    mine, theirs = _kv_cache_dtype(local.schema), _kv_cache_dtype(remote.schema)
    if mine != theirs:
        problems.append(
            sides.differs("", "kv_cache_dtype", mine, theirs)
            + ": start both with the same --kv-cache-dtype"
        )
    mine, theirs = _dtypes(local.schema), _dtypes(remote.schema)
    if mine and theirs and mine != theirs:
        problems.append(
            sides.differs("", "compute dtype", "/".join(sorted(mine)), "/".join(sorted(theirs)))
            + ": start both with the same --dtype (e.g. --dtype float32 on both; --dtype auto "
            "picks bfloat16 only on a CPU with native bf16, so it can differ between hosts)"
        )
    return problems + schema_problems(local, remote)


def _dtypes(schema: list[dict[str, Any]]) -> set[str]:
    """The dtypes a schema's components hold (the model's compute dtype; not those of K/V
    pools holding rows otherwise, ``_kv_cache_dtype``)."""
    return {
        c["dtype"]
        for c in schema
        if isinstance(c, dict) and isinstance(c.get("dtype"), str) and not c.get("row_format")
    }


def _kv_cache_dtype(schema: list[dict[str, Any]]) -> str:
    """How a schema's K/V components hold rows (``kv_format``): ``int8``, ``bfloat16`` (an
    fp32 model's bf16 rows) or ``auto`` (as computed)."""
    formats = {c.get("row_format") for c in schema if isinstance(c, dict)}
    return next((kv for kv, f in kv_format.ROW_FORMATS.items() if f in formats), "auto")


def check_pairing(local: PeerInfo, remote: PeerInfo) -> None:
    """Raise ``PairingError`` naming every difference that forbids this pairing."""
    problems = pairing_problems(local, remote)
    if problems:
        raise PairingError(
            f"cannot pair {local.role} worker {local.worker_id!r} with {remote.role} worker "
            f"{remote.worker_id!r}: " + "; ".join(problems),
            problems,
        )
