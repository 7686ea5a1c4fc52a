"""Loading (and saving) Hugging Face model directories.

A directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json``; optionally ``mtp_config.json`` + ``mtp.safetensors`` for
the MTP draft. Tensors are copied by name into the modules built from the ``ModelSpec``;
a missing or unexpected tensor is a ``ValueError`` naming it. A config.json with a
``quantization_config`` is a pre-quantized checkpoint: ``prequantized`` checks it (or
refuses it) and takes its integer tensors (int8 or int4), the rest loads as for a float
checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from baton import platform
from baton.model.decoder import CausalLM
from baton.model.draft import DRAFT_CONFIG_FILE, DraftSpec, MTPDraft
from baton.model.matmul_context import weights_held_once
from baton.model.prequantized import QuantizedTensors, check_config
from baton.model.registry import spec_from_config
from baton.model.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers some exporters write that carry no information for us.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Tensors a family's checkpoints hold beside the model that baton does not load: Qwen3.5 ships
# its MTP head as mtp.* in model.safetensors (not yet: issue 45, phase 3 loads it as the
# draft), and its published checkpoints a vision tower (baton serves text only).
IGNORED_PREFIXES = {
    "Qwen3_5ForCausalLM": ("mtp.",),
    "Qwen3_5ForConditionalGeneration": ("mtp.", "model.visual."),
}
# Checkpoint name prefixes that differ from the module tree's: (the checkpoint's, ours).
RENAMED_PREFIXES = {"Qwen3_5ForConditionalGeneration": (("model.language_model.", "model."),)}
log = logging.getLogger(__name__)


def resolve_dtype(dtype: str | torch.dtype | None, default: str) -> torch.dtype:
    """The compute dtype: ``dtype`` as given, ``default`` (the checkpoint's) for None, and
    for ``"auto"`` what ``Platform.auto_dtype`` makes of the checkpoint's on this CPU. An
    explicit bf16 where bf16 is not native works (slowly) after one warning."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = platform.current().auto_dtype(default)
    name = dtype or default
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: auto, {', '.join(DTYPES)}")
    if name == "bfloat16" and not platform.current().native_bf16:
        _warn_slow_bf16()
    return DTYPES[name]


@cache
def _warn_slow_bf16() -> None:
    log.warning(
        "computing in bfloat16 on a CPU without native bf16 (%s): matmuls run ~10x slower "
        "than in float32; pass --dtype float32 (or auto)",
        platform.current().cpu_name,
    )


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} not found")
    with open(path) as f:
        return json.load(f)


def load_spec(model_dir: str | os.PathLike) -> ModelSpec:
    """The spec of ``model_dir``'s config.json; a quantization baton cannot load is a
    ``ValueError`` here already (``prequantized.check_config``)."""
    config = read_json(Path(model_dir) / "config.json")
    check_config(config, str(model_dir))
    return spec_from_config(config)


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        return [model_dir / s for s in shards]
    raise ValueError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """``safe_open`` of ``path``; a damaged file (truncated, not safetensors) is a
    ``ValueError`` naming it, not the library's bare 'incomplete metadata'."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    with handle as f:
        try:
            yield f
        except SafetensorError as e:
            raise ValueError(f"{path}: a tensor could not be read ({e})") from e


def load_tensors_into(
    module: nn.Module,
    files: list[Path],
    prefix: str = "",
    quantized: QuantizedTensors | None = None,
    ignored_prefixes: tuple[str, ...] = (),
    renamed_prefixes: tuple[tuple[str, str], ...] = (),
) -> None:
    """Copy every tensor of ``files`` into ``module``'s parameters of the same name (those
    whose name starts with one of ``ignored_prefixes`` skipped, ``renamed_prefixes``'
    (checkpoint's, ours) applied); with ``quantized``, a pre-quantized checkpoint's integer
    tensors go to it (``QuantizedTensors.take``) and it fills those projections' weights at
    the end (``install``)."""
    params = dict(module.named_parameters())  # tied weights appear once
    loaded: set[str] = set()
    for path in files:
        with _opened(path) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = key[len(prefix) :] if key.startswith(prefix) else None
                if name is None or name.endswith(IGNORED_SUFFIXES):
                    continue
                if name.startswith(ignored_prefixes):
                    continue
                for theirs, ours in renamed_prefixes:
                    if name.startswith(theirs):
                        name = ours + name[len(theirs) :]
                tensor = f.get_tensor(key)
                if quantized is not None and quantized.take(name, tensor):
                    continue
                if name not in params:
                    raise ValueError(f"{path.name}: unexpected tensor {key!r}")
                _copy(params[name], tensor, path, key)
                loaded.add(name)
    if quantized is not None:
        loaded |= quantized.install()
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def _copy(param: nn.Parameter, tensor: torch.Tensor, path: Path, key: str) -> None:
    if tensor.shape != param.shape:
        raise ValueError(
            f"{path.name}: tensor {key!r} has shape {tuple(tensor.shape)}, "
            f"the config implies {tuple(param.shape)}"
        )
    if param.is_floating_point() and not tensor.is_floating_point():
        # NOTE: copy_ would turn an int8 weight into its integers as floats, silently.
        raise ValueError(
            f"{path.name}: tensor {key!r} is {tensor.dtype}, not float, and config.json "
            "declares no quantization_config"
        )
    with torch.no_grad():
        param.copy_(tensor)


SECOND_COPY_SHARE = 0.5
"""``weight_copies`` None (auto) holds a bf16 model's weights twice where both copies take
at most this share of the memory available before loading."""


def load_fused_model(
    model_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
    weight_copies: int | None = None,
) -> CausalLM:
    """``load_model(model_dir, dtype).fuse_projections(quantization)`` -- the same model --
    without ever holding it whole in a dtype wider than the checkpoint's: a bf16 checkpoint
    computed in fp32 is loaded as it is and each layer widened just before it is
    fused (``CausalLM.fuse_projections``' ``dtype``), where the plain order held every
    weight in fp32 first (Qwen3-1.7B: ~6.9 GB of fp32 parameters for a 3.4 GB checkpoint,
    which fusing then turned into 2.4 GB of panels). A quantized model is quantized from
    the layer so widened too.

    weight_copies: where oneDNN computes bf16 (``frozen_linear.can_pack``), a large weight
    is held twice -- oneDNN's packed copy for prompt steps, linear.c's panels for small
    ones -- or, with 1, in the panels alone (``matmul_context.weights_held_once``: prompt
    steps ~0.9x); None decides by memory (``SECOND_COPY_SHARE``). The model's
    ``weights_held_once`` says which was done where it matters."""
    available = platform.available_memory_bytes()  # before the model takes its share
    model = load_model(model_dir, dtype, narrow=True)
    if weight_copies is None:
        weight_copies = weight_copies_that_fit(model_dir, available)
    torch_dtype = resolve_dtype(dtype, model.spec.dtype)
    widen = torch_dtype if _is_narrower(DTYPES[model.spec.dtype], torch_dtype) else None
    packs = torch_dtype == torch.bfloat16 and platform.current().native_bf16
    once = packs and weight_copies == 1 and not (model.checkpoint_quantization or quantization)
    with weights_held_once(once):
        model.fuse_projections(quantization, dtype=widen)
    model.weights_held_once = once
    return model


def weight_copies_that_fit(
    model_dir: str | os.PathLike, available: int | None, num_engines: int = 1
) -> int:
    """2 where ``num_engines`` engines' two copies of the checkpoint's weights take at most
    ``SECOND_COPY_SHARE`` of ``available`` bytes (``platform.available_memory_bytes``; None:
    unknown), else 1 (``baton launch`` decides once for all its workers: a prefill and a
    decode that differ cannot pair)."""
    weights = sum(path.stat().st_size for path in _weight_files(Path(model_dir)))
    needed = 2 * weights * num_engines
    return 1 if available is not None and needed > SECOND_COPY_SHARE * available else 2


def _is_narrower(checkpoint: torch.dtype, compute: torch.dtype) -> bool:
    """Loaded narrow: a bf16 checkpoint computed in fp32 (``FrozenLinear`` packs bf16
    weights as they are; fp16 ones it would widen anyway)."""
    return checkpoint == torch.bfloat16 and compute == torch.float32


def load_model(
    model_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    narrow: bool = False,
) -> CausalLM:
    """Build and fill the target model of ``model_dir`` in ``dtype`` (default: checkpoint's);
    with ``narrow``, in the checkpoint's dtype where that is the narrower one (the caller
    widens it: ``load_fused_model``). A pre-quantized checkpoint's projections carry their
    integer weights (``quantized``; the float weights hold their values) and
    ``checkpoint_quantization`` says ``int8`` / ``int4``."""
    model_dir = Path(model_dir)
    config = read_json(model_dir / "config.json")
    quantization = check_config(config, str(model_dir))
    spec = spec_from_config(config)
    torch_dtype = resolve_dtype(dtype, spec.dtype)
    if narrow and _is_narrower(DTYPES[spec.dtype], torch_dtype):
        torch_dtype = DTYPES[spec.dtype]
    with torch.device("meta"):
        model = CausalLM(spec)
    model = model.to_empty(device="cpu").to(torch_dtype)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    quantized = (
        QuantizedTensors(model, config, quantization, str(model_dir)) if quantization else None
    )
    load_tensors_into(
        model,
        _weight_files(model_dir),
        quantized=quantized,
        ignored_prefixes=IGNORED_PREFIXES.get(spec.architecture, ()),
        renamed_prefixes=RENAMED_PREFIXES.get(spec.architecture, ()),
    )
    model.checkpoint_quantization = quantization
    return model.eval()


def has_draft(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / DRAFT_CONFIG_FILE).is_file()


def load_draft(model_dir: str | os.PathLike, target: CausalLM) -> MTPDraft | None:
    """The MTP draft stored beside the target, or None if the directory has none."""
    model_dir = Path(model_dir)
    if not has_draft(model_dir):
        return None
    draft_spec = DraftSpec.from_json(read_json(model_dir / DRAFT_CONFIG_FILE))
    weights = model_dir / draft_spec.weights_file
    if not weights.is_file():
        raise ValueError(f"{DRAFT_CONFIG_FILE} names {draft_spec.weights_file}, not found")
    draft = MTPDraft(target.spec, draft_spec)
    dtype = target.model.embed_tokens.weight.dtype
    draft = draft.to(dtype)
    load_tensors_into(draft, [weights])
    return draft.eval()


def save_draft(model_dir: str | os.PathLike, draft: MTPDraft, dtype: torch.dtype) -> None:
    model_dir = Path(model_dir)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items()}
    tensors = {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}
    save_file(tensors, str(model_dir / draft.draft_spec.weights_file), metadata={"format": "pt"})
    with open(model_dir / DRAFT_CONFIG_FILE, "w") as f:
        json.dump(draft.draft_spec.to_json(), f, indent=2)
