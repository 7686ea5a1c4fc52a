"""Pre-quantized checkpoints: the ``compressed-tensors`` int8 per-channel format.

``config.json``'s ``quantization_config`` (``quant_method: compressed-tensors``) is read
here, and what baton can load is accepted: every config group's weights symmetric int8, one
scale per output channel (``strategy: channel``); input activations none or int8 per token
computed at run time (``dynamic: true, strategy: token``). Anything else -- 4-bit or fp8
weights, group / tensor / block scales, zero points, static activation scales, sparsity,
transforms, a quantized KV cache -- is a one-line ``ValueError`` naming it. Per projection
(``<m>`` a module name such as ``model.layers.0.self_attn.q_proj``) the checkpoint holds:

    format int-quantized / naive-quantized    format pack-quantized (num_bits 8)
      <m>.weight        int8 [n, k]             <m>.weight_packed  int32 [n, ceil(k / 4)]
                                                <m>.weight_shape   int64 [2] = (n, k)
      <m>.weight_scale  f16 / bf16 / f32 [n, 1]: row j of the weight is q[j] * scale[j]
      <m>.weight_zero_point  (older writers only) all zeros

A packed word holds 4 consecutive values of a row, value i in bits 8 i .. 8 i + 7, each
stored as q + 128. Values span [-128, 127] (the writer rounds w / (max|w| / 127.5)).

Projections the checkpoint left float (``ignore``, typically ``lm_head``) load as float and
carry no ``quantized``; since the model's ``checkpoint_quantization`` is ``int8``,
``FrozenLinear`` quantizes them itself at fuse time (``quantize.quantize_int8``), as
``--quantization int8`` would. q, k and v fuse into one matmul, so they must be alike.

Who calls it: ``loader.load_spec`` and ``loader.load_model`` (``check_config``), and
``loader.load_tensors_into`` (``Int8Tensors`` takes these tensors while the loader copies the
rest by name). It attaches ``QuantizedWeight``s to the projections and never touches the
matmuls: ``fuse_projections`` keeps them as they are (``CausalLM.checkpoint_quantization``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from baton.model.quantize import QuantizedWeight, dequantize

METHOD = "compressed-tensors"
INT8_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
SUPPORTED = "baton loads int8 per-channel checkpoints ('int-quantized', or 8-bit 'pack-quantized')"
REFUSED_TENSORS = {
    "input_scale": "static input activation scales",
    "input_zero_point": "static input activation zero points",
    "output_scale": "output activation scales",
    "k_scale": "KV cache scales",
    "v_scale": "KV cache scales",
    "weight_g_idx": "activation reordering (g_idx)",
    "weight_global_scale": "global weight scales",
}
"""Tensor names (last component) of schemes baton does not load, and what they are."""


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what} is not supported: {SUPPORTED}")


def check_config(config: dict[str, Any], where: str) -> str | None:
    """``"int8"`` for a config.json whose ``quantization_config`` describes a checkpoint
    this module loads, None for one without; else a ``ValueError`` naming what is
    unsupported (``where``: the model directory, for the message)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != METHOD:
        raise _refuse(where, f"quantization_config with quant_method {method!r}")
    for key, what in (
        ("sparsity_config", "sparsity"),
        ("transform_config", "weight transforms"),
        ("kv_cache_scheme", "a quantized KV cache"),
        ("moe_sparsity_config", "expert sparsity"),
    ):
        if qc.get(key):
            raise _refuse(where, f"compressed-tensors {key} ({what})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, "compressed-tensors quantization_config without config_groups")
    for name, group in groups.items():
        _check_group(name, group, qc.get("format"), where)
    return "int8"


def _check_group(name: str, group: Any, global_format: str | None, where: str) -> None:
    if not isinstance(group, dict):  # a preset's name mapped to its targets
        raise _refuse(where, f"compressed-tensors preset scheme {name!r} (spell the scheme out)")
    weights = group.get("weights")
    if not weights:
        raise _refuse(where, f"config group {name!r} without weight quantization")
    bits, kind = weights.get("num_bits", 8), weights.get("type", "int")
    fmt = group.get("format") or global_format
    if fmt not in INT8_FORMATS or bits != 8 or kind != "int":
        raise _refuse(where, f"compressed-tensors format {fmt!r} ({bits}-bit {kind} weights)")
    if not weights.get("symmetric", True):
        raise _refuse(where, f"config group {name!r}: asymmetric weights (zero points)")
    strategy = _strategy(weights)
    if strategy != "channel":
        size = f", group_size {weights.get('group_size')}" if strategy == "group" else ""
        raise _refuse(where, f"config group {name!r}: weight strategy {strategy!r}{size}")
    if weights.get("dynamic"):
        raise _refuse(where, f"config group {name!r}: dynamic weight quantization")
    if group.get("output_activations"):
        raise _refuse(where, f"config group {name!r}: output activation quantization")
    inputs = group.get("input_activations")
    if inputs:
        dynamic = inputs.get("dynamic")
        if not dynamic:
            raise _refuse(where, f"config group {name!r}: static input activation scales")
        if dynamic is not True:
            raise _refuse(where, f"config group {name!r}: input activations dynamic {dynamic!r}")
        what = (
            f"{inputs.get('num_bits', 8)}-bit {inputs.get('type', 'int')} "
            f"{'symmetric' if inputs.get('symmetric', True) else 'asymmetric'} "
            f"{_strategy(inputs)!r} input activations"
        )
        if what != "8-bit int symmetric 'token' input activations":
            raise _refuse(where, f"config group {name!r}: {what}")


def _strategy(args: dict[str, Any]) -> str:
    """``QuantizationArgs``' strategy, inferred from group_size where unset (as the
    package does: none -> tensor, -1 -> channel, positive -> group)."""
    if args.get("strategy"):
        return str(args["strategy"]).lower()
    size = args.get("group_size")
    return "tensor" if size is None else "channel" if size == -1 else "group"


class Int8Tensors:
    """The int8 tensors of one checkpoint, taken while the loader reads its files, then
    attached to the model's projections (``install``)."""

    def __init__(self, model: nn.Module, where: str) -> None:
        self.where = where
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._owners = {id(p): n for n, p in model.named_parameters()}  # tied: first name
        self._modules = dict(model.named_modules())
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` if it is one of a quantized projection's (True); False leaves it
        to the loader."""
        module, _, leaf = name.rpartition(".")
        if leaf in REFUSED_TENSORS:
            raise _refuse(self.where, f"tensor {name!r} ({REFUSED_TENSORS[leaf]})")
        if leaf == "weight" and tensor.dtype == torch.int8:
            leaf = "q"
        elif leaf not in ("weight_scale", "weight_zero_point", "weight_packed", "weight_shape"):
            return False
        self._parts.setdefault(module, {})[leaf] = tensor
        return True

    def install(self) -> set[str]:
        """Attach every projection's ``QuantizedWeight`` (``linear.quantized``) and fill its
        float weight with the dequantized values; the parameter names filled."""
        filled = set()
        for module, parts in sorted(self._parts.items()):
            linear = self._linears.get(module)
            if linear is None:
                raise _refuse(self.where, f"int8 tensors for {module!r} (not a Linear layer)")
            owner = self._owners.get(id(linear.weight))
            if owner != f"{module}.weight":
                raise _refuse(self.where, f"an int8 {module!r} whose weight is {owner!r}'s")
            qw = self._quantized_weight(module, parts, tuple(linear.weight.shape))
            linear.quantized = qw
            with torch.no_grad():
                linear.weight.copy_(dequantize(qw, linear.weight.dtype))
            filled.add(f"{module}.weight")
        if not filled:
            raise ValueError(f"{self.where}: config.json declares {METHOD} but no tensor is int8")
        self._check_qkv_alike()
        return filled

    def _quantized_weight(
        self, module: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]
    ) -> QuantizedWeight:
        n, k = shape
        if "q" in parts:
            q = parts["q"]
        elif "weight_packed" in parts:
            q = self._unpack(module, parts, shape)
        else:
            raise ValueError(f"{self.where}: {module}.weight_scale without an int8 weight")
        if tuple(q.shape) != shape:
            raise ValueError(
                f"{self.where}: {module} is int8 {tuple(q.shape)}, the config implies {shape}"
            )
        scale = parts.get("weight_scale")
        if scale is None:
            raise ValueError(f"{self.where}: {module} is int8 but has no weight_scale")
        if not scale.is_floating_point() or tuple(scale.shape) not in ((n, 1), (n,)):
            raise _refuse(
                self.where,
                f"{module}.weight_scale {scale.dtype} {tuple(scale.shape)} (not one float "
                f"per output channel, [{n}, 1])",
            )
        zero_point = parts.get("weight_zero_point")
        if zero_point is not None and bool(torch.any(zero_point != 0)):
            raise _refuse(self.where, f"{module}.weight_zero_point (asymmetric weights)")
        return QuantizedWeight(q.contiguous(), scale.float().reshape(n).contiguous())

    def _unpack(
        self, module: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """pack-quantized, 8 bits: [n, ceil(k / 4)] int32 -> the [n, k] int8 values."""
        n, k = shape
        packed, stored = parts["weight_packed"], parts.get("weight_shape")
        if stored is not None and tuple(stored.tolist()) != shape:
            raise ValueError(f"{self.where}: {module}.weight_shape is {stored.tolist()}")
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, math.ceil(k / 4)):
            raise _refuse(
                self.where,
                f"{module}.weight_packed {packed.dtype} {tuple(packed.shape)} (8-bit values "
                f"pack as [{n}, {math.ceil(k / 4)}] int32)",
            )
        shifts = torch.arange(0, 32, 8, dtype=torch.int32)
        unsigned = (packed[:, :, None] >> shifts) & 0xFF  # [n, k / 4, 4]: value 4 w + i
        return (unsigned.reshape(n, -1)[:, :k] - 128).to(torch.int8)

    def _check_qkv_alike(self) -> None:
        """q, k and v fuse into one matmul (``quantize.concat_rows``): all int8, or none."""
        for name, module in self._modules.items():
            projections = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj")]
            if not all(isinstance(p, nn.Linear) for p in projections):
                continue
            int8 = [getattr(p, "quantized", None) is not None for p in projections]
            if any(int8) and not all(int8):
                kinds = ", ".join(
                    f"{p} {'int8' if i else 'float'}"
                    for p, i in zip(("q_proj", "k_proj", "v_proj"), int8, strict=True)
                )
                raise _refuse(self.where, f"{name}: q, k and v quantized differently ({kinds})")
