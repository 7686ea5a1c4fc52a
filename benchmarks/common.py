"""Helpers the benchmark scripts share: a random Qwen3 checkpoint and machine facts."""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from baton import platform as baton_platform

BUNDLED_SHAPE = dict(vocab=4096, hidden=256, intermediate=768, layers=6, heads=4, kv_heads=2)
"""The bundled model's shape (scripts/train_bundled.py): the stand-in before it is trained."""
PAD_ID = 0


def save_random_qwen3(out_dir: Path, dtype: torch.dtype, window: int | None, **shape) -> Path:
    """A random Qwen3 with tied embeddings; ``window`` makes even layers sliding."""
    layers = shape["layers"]
    sliding = [window is not None and i % 2 == 0 for i in range(layers)]
    config = transformers.Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=0,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        bos_token_id=None,
        eos_token_id=PAD_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir)
    return out_dir


def decode_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(values, bytes) of the weights a decode step reads: every ``FrozenLinear``'s packed
    panels (what ``linear.c`` computes with -- q|k|v, o, gate, up, down, the head: a tied
    embedding once, as the head; quantized ones in their own bytes) and the parameters of
    everything but the embedding tables (norms; any weight no ``FrozenLinear`` holds), whose
    rows a step gathers but does not stream. Not ``model.parameters()``: the packed weights
    are not parameters (a model keeps one copy of a weight, in the panels)."""
    from baton.kernels.linear import PackedRows
    from baton.model.frozen_linear import FrozenLinear

    linears: dict[int, FrozenLinear] = {}
    for module in model.modules():
        for attr in vars(module).values():
            if isinstance(attr, FrozenLinear):
                linears[id(attr)] = attr
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    # each parameter once (a tied head is the embedding's); fused modules' are empty
    params = {id(p): p for p in model.parameters() if id(p) not in tables}
    values = sum(p.numel() for p in params.values())
    size = sum(p.numel() * p.element_size() for p in params.values())
    for linear in linears.values():
        rows = linear.rows()
        w = linear.effective_weight() if rows is None else rows[0]  # None: native layers off
        if isinstance(w, PackedRows):
            values, size = values + w.n * w.k, size + w.nbytes
        else:  # a float weight, or a QuantizedWeight's values (its scales aside)
            w = getattr(w, "q", w)
            values, size = values + w.numel(), size + w.numel() * w.element_size()
    return values, size


def memcpy_bytes_per_s(num_mib: int, repeats: int = 5) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``num_mib`` MiB (median of
    ``repeats`` after one warm-up)."""
    src = torch.ones(num_mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return 2 * src.numel() / statistics.median(seconds)


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if names:
            return names[0].split(":", 1)[1].strip()
    return platform.processor()


def machine_facts(dtype: str, **extra) -> dict:
    """What a result was measured on: versions, CPU (``baton.platform``: kernel level, native
    bf16, usable cores), threads, dtype, plus ``extra``."""
    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "cpu": cpu_name(),
        "platform": baton_platform.current().as_dict(),
        "num_threads": torch.get_num_threads(),
        "dtype": dtype,
        **extra,
    }


def resolve_dtype_arg(dtype: str) -> str:
    """``--dtype auto`` (the default): bfloat16 where this CPU computes it natively, else
    float32 -- for both sides, baton and its peer. Prints the platform line once."""
    current = baton_platform.current()
    resolved = current.auto_dtype("bfloat16") if dtype == "auto" else dtype
    print(f"{current.summary()}; dtype {resolved}{' (auto)' if dtype == 'auto' else ''}")
    return resolved
