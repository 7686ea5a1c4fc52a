"""Pre-quantized checkpoints: the ``compressed-tensors`` int8 and int4 formats.

``config.json``'s ``quantization_config`` (``quant_method: compressed-tensors``) is read
here, and what baton can load is accepted: every config group's weights symmetric int, all
of one width -- 8-bit with one scale per output channel (``strategy: channel``: W8A8, W8A16)
or 4-bit with one scale per group of ``group_size`` inputs of a row, a multiple of 32
(``strategy: group``: W4A16, W4A8); input activations none or int8 per token computed at
run time (``dynamic: true, strategy: token``). Anything else -- fp8 / fp4 weights, other
widths, strategies or group sizes, zero points, activation reordering (g_idx), static
activation scales, sparsity, transforms, a quantized KV cache -- is a one-line
``ValueError`` naming it. Per projection (``<m>`` a module name such as
``model.layers.0.self_attn.q_proj``; b the width, 8 or 4; g the group size) it holds:

    format int-quantized / naive-quantized    format pack-quantized
      <m>.weight        int8 [n, k]             <m>.weight_packed  int32 [n, ceil(k b / 32)]
                                                <m>.weight_shape   int64 [2] = (n, k)
      <m>.weight_scale  f16 / bf16 / f32
        8-bit: [n, 1]      row j of the weight is q[j] * scale[j]
        4-bit: [n, k / g]  input i of row j is q[j, i] * scale[j, i // g]; k a multiple of g
      <m>.weight_zero_point  (older writers only) all zeros

(The package writes W8A8 and W4A8 int-quantized, one value per int8; W8A16 and W4A16
pack-quantized.) A packed word holds 32 / b consecutive values of a row, value i in bits
b i .. b i + b - 1, each stored as q + 2^(b - 1) (the package's ``pack_to_int32``,
``compressors/pack_quantized/helpers.py``); for b = 4, word w of a row:

    bits   31..28     27..24     23..20     ...   7..4       3..0
           q[8w+7]+8  q[8w+6]+8  q[8w+5]+8  ...   q[8w+1]+8  q[8w]+8

Values span [-2^(b-1), 2^(b-1) - 1]: the writer rounds w / (max|w| / (2^(b-1) - 0.5)), so
a row's (group's) largest |w|, if negative, is -128 (-8). baton's int4 weight has one scale
per ``INT4_GROUP`` (32) inputs: a checkpoint's group of g inputs, g a multiple of 32, is
exactly g / 32 of them, each with the group's scale.

Projections the checkpoint left float (``ignore``, typically ``lm_head``) load as float and
carry no ``quantized``; the model's ``checkpoint_quantization`` (``int8`` / ``int4``) has
``FrozenLinear`` quantize them itself at fuse time (``quantize.quantize_int8`` /
``quantize_int4``), as ``--quantization`` would. q, k and v fuse into one matmul, so they
must be alike.

Who calls it: ``loader.load_spec`` and ``loader.load_model`` (``check_config``), and
``loader.load_tensors_into`` (``QuantizedTensors`` takes these tensors while the loader
copies the rest by name). It attaches ``QuantizedWeight``s to the projections and never
touches the matmuls: ``fuse_projections`` keeps them as they are
(``CausalLM.checkpoint_quantization``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from baton.kernels.linear import INT4_GROUP
from baton.model.quantize import QuantizedWeight, dequantize

METHOD = "compressed-tensors"
INT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
METHODS = {8: "int8", 4: "int4"}
"""Weight width (``num_bits``) -> the ``QuantizedWeight`` method it loads as."""
STRATEGIES = {8: "channel", 4: "group"}
"""Weight width -> the one scale strategy baton loads for it."""
SUPPORTED = (
    "baton loads symmetric int8 per-channel and int4 per-group "
    f"(group_size a multiple of {INT4_GROUP}) checkpoints"
)
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
    """``"int8"`` or ``"int4"`` for a config.json whose ``quantization_config`` describes a
    checkpoint this module loads, None for one without; else a ``ValueError`` naming what is
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
    methods = {
        name: _check_group(name, group, qc.get("format"), where) for name, group in groups.items()
    }
    if len(set(methods.values())) > 1:  # one checkpoint, one QuantizedWeight method
        kinds = ", ".join(f"{name} {method}" for name, method in methods.items())
        raise _refuse(where, f"config groups of 8-bit and 4-bit weights ({kinds})")
    return next(iter(methods.values()))


def _check_group(name: str, group: Any, global_format: str | None, where: str) -> str:
    """The method of one config group's weights (``METHODS``), or a ``ValueError``."""
    if not isinstance(group, dict):  # a preset's name mapped to its targets
        raise _refuse(where, f"compressed-tensors preset scheme {name!r} (spell the scheme out)")
    weights = group.get("weights")
    if not weights:
        raise _refuse(where, f"config group {name!r} without weight quantization")
    bits, kind = weights.get("num_bits", 8), weights.get("type", "int")
    fmt = group.get("format") or global_format
    if fmt not in INT_FORMATS or bits not in METHODS or kind != "int":
        raise _refuse(where, f"compressed-tensors format {fmt!r} ({bits}-bit {kind} weights)")
    if not weights.get("symmetric", True):
        raise _refuse(where, f"config group {name!r}: asymmetric {bits}-bit weights (zero points)")
    strategy, size = _strategy(weights), weights.get("group_size")
    if strategy != STRATEGIES[bits]:
        shown = f", group_size {size}" if strategy == "group" else ""
        raise _refuse(
            where, f"config group {name!r}: {bits}-bit weight strategy {strategy!r}{shown}"
        )
    if strategy == "group" and (not isinstance(size, int) or size <= 0 or size % INT4_GROUP):
        raise _refuse(where, f"config group {name!r}: 4-bit weights with group_size {size}")
    # NOTE: actorder "weight" orders GPTQ's calibration only; the stored weights are in input
    # order, one scale per consecutive group. "group" (a g_idx per input) is what differs.
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight"):
        raise _refuse(where, f"config group {name!r}: actorder {actorder!r} (g_idx)")
    if weights.get("dynamic"):
        raise _refuse(where, f"config group {name!r}: dynamic weight quantization")
    if group.get("output_activations"):
        raise _refuse(where, f"config group {name!r}: output activation quantization")
    if group.get("input_activations"):
        _check_inputs(name, group["input_activations"], where)
    return METHODS[bits]


def _check_inputs(name: str, inputs: dict[str, Any], where: str) -> None:
    """A config group's input activations: int8 per token, computed at run time (the small
    steps' W8A8 / W4A8 rows are), or a ``ValueError``."""
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


class QuantizedTensors:
    """The integer tensors of one checkpoint whose config ``check_config`` accepted (as
    ``method``), taken while the loader reads its files, then attached to the model's
    projections (``install``)."""

    def __init__(self, model: nn.Module, config: dict[str, Any], method: str, where: str) -> None:
        self.where = where
        self.method = method
        """``check_config``'s answer for ``config``: ``int8`` or ``int4``."""
        self.bits = 8 if method == "int8" else 4
        groups = config["quantization_config"]["config_groups"].values()
        sizes = {g["weights"]["group_size"] for g in groups} if self.bits == 4 else set()
        self.group_sizes = sorted(sizes)
        """int4: the config's group sizes (one per config group), for the scales' shapes."""
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
                raise _refuse(self.where, f"quantized tensors for {module!r} (not a Linear layer)")
            owner = self._owners.get(id(linear.weight))
            if owner != f"{module}.weight":
                raise _refuse(self.where, f"a quantized {module!r} whose weight is {owner!r}'s")
            qw = self._quantized_weight(module, parts, tuple(linear.weight.shape))
            linear.quantized = qw
            with torch.no_grad():
                linear.weight.copy_(dequantize(qw, linear.weight.dtype))
            filled.add(f"{module}.weight")
        if not filled:
            raise ValueError(
                f"{self.where}: config.json declares {METHOD} but no tensor is quantized"
            )
        self._check_qkv_alike()
        return filled

    def _quantized_weight(
        self, module: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]
    ) -> QuantizedWeight:
        if "q" in parts:
            q = parts["q"]
        elif "weight_packed" in parts:
            q = self._unpack(module, parts, shape)
        else:
            raise ValueError(f"{self.where}: {module}.weight_scale without an integer weight")
        if tuple(q.shape) != shape:
            raise ValueError(
                f"{self.where}: {module} is {self.method} {tuple(q.shape)}, the config "
                f"implies {shape}"
            )
        low, high = -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        if self.bits < 8 and bool(torch.any((q < low) | (q > high))):
            raise ValueError(f"{self.where}: {module} holds values outside {low}..{high}")
        scale = parts.get("weight_scale")
        if scale is None:
            raise ValueError(f"{self.where}: {module} is {self.method} but has no weight_scale")
        zero_point = parts.get("weight_zero_point")
        # NOTE: the writer stores zero points only for asymmetric weights (the config check
        # refuses those); a zero one of an older writer is all zeros, never packed.
        if zero_point is not None and bool(torch.any(zero_point != 0)):
            raise _refuse(self.where, f"{module}.weight_zero_point (asymmetric weights)")
        to_baton = self._int8_scale if self.bits == 8 else self._int4_scale
        return QuantizedWeight(q.contiguous(), to_baton(module, scale, shape).contiguous())

    def _int8_scale(self, module: str, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The checkpoint's [n, 1] scales -> baton's int8 [n] fp32."""
        n, _ = shape
        if not scale.is_floating_point() or tuple(scale.shape) not in ((n, 1), (n,)):
            raise _refuse(
                self.where,
                f"{module}.weight_scale {scale.dtype} {tuple(scale.shape)} (not one float "
                f"per output channel, [{n}, 1])",
            )
        return scale.float().reshape(n)

    def _int4_scale(self, module: str, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The checkpoint's [n, k / g] scales -> baton's int4 [n, k / 32] fp32: each group's
        scale g / 32 times."""
        n, k = shape
        fits = (g for g in self.group_sizes if tuple(scale.shape) == (n, math.ceil(k / g)))
        size = next(fits, None)
        if not scale.is_floating_point() or size is None:
            sizes = " or ".join(map(str, self.group_sizes))
            raise _refuse(
                self.where,
                f"{module}.weight_scale {scale.dtype} {tuple(scale.shape)} (not one float per "
                f"group of {sizes} inputs, [{n}, {k} / group_size])",
            )
        if k % size:  # the package refuses to write one (no reference to load it by)
            raise _refuse(self.where, f"{module}: {k} inputs in groups of {size} (a partial group)")
        return scale.float().repeat_interleave(size // INT4_GROUP, dim=1)

    def _unpack(
        self, module: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """pack-quantized, b = ``bits`` (8 or 4): [n, ceil(k b / 32)] int32 -> the [n, k]
        int8 values (the module docstring's picture)."""
        n, k = shape
        per_word = 32 // self.bits
        packed, stored = parts["weight_packed"], parts.get("weight_shape")
        if stored is not None and tuple(stored.tolist()) != shape:
            raise ValueError(f"{self.where}: {module}.weight_shape is {stored.tolist()}")
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, math.ceil(k / per_word)):
            raise _refuse(
                self.where,
                f"{module}.weight_packed {packed.dtype} {tuple(packed.shape)} ({self.bits}-bit "
                f"values pack as [{n}, {math.ceil(k / per_word)}] int32)",
            )
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32)
        mask, offset = (1 << self.bits) - 1, 1 << (self.bits - 1)
        # [n, words, per_word]: value per_word w + i of the row
        unsigned = (packed[:, :, None] >> shifts) & mask
        return (unsigned.reshape(n, -1)[:, :k] - offset).to(torch.int8)

    def _check_qkv_alike(self) -> None:
        """q, k and v fuse into one matmul (``quantize.concat_rows``): all quantized, or none."""
        for name, module in self._modules.items():
            projections = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj")]
            if not all(isinstance(p, nn.Linear) for p in projections):
                continue
            quantized = [getattr(p, "quantized", None) is not None for p in projections]
            if any(quantized) and not all(quantized):
                kinds = ", ".join(
                    f"{p} {self.method if i else 'float'}"
                    for p, i in zip(("q_proj", "k_proj", "v_proj"), quantized, strict=True)
                )
                raise _refuse(self.where, f"{name}: q, k and v quantized differently ({kinds})")
