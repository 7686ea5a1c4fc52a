"""Python side of ``layer.c``: a whole decoder layer of a small step in one native call.

``NativeLayer.build`` takes one layer's weights (plain tensors: this module knows nothing of
the model's classes) and returns None where ``layer.c`` does not apply: no kernels, a dtype
it does not read, an activation it has no epilogue for. ``baton.model.decoder.DecoderLayer``
builds one at ``fuse_projections`` and calls it for steps of at most ``MAX_TOKENS`` tokens
whose attention backend offers the paged attention kernel's index lists; its torch path
stays the reference (tests compare the two). ``BATON_NATIVE_LAYERS=0`` turns it off.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from baton.config import RuntimeEnv
from baton.kernels import DTYPES, library, small_step_threads
from baton.kernels.layer_abi import LayerArgs, StackArgs, StackLayerArgs, StackPlanArgs, StepArgs
from baton.kernels.linear import (
    ACTIVATIONS,
    MAX_ROWS,
    ROUND_ONCE,
    WEIGHT_FORMATS,
    PackedRows,
    max_rows_beside_onednn,
)
from baton.kernels.norm import MAX_DIM, torch_lanes

MAX_TOKENS = MAX_ROWS
"""Steps up to this many tokens take the native layer (above it BLAS's matmuls win); beside
oneDNN's packed bf16 matmuls up to ``linear.max_rows_beside_onednn`` of its largest matrix
(``NativeLayer.max_tokens``)."""

NORMS = ("input_norm", "post_norm", "qk_norm")
MATRICES = ("qkv", "o", "gate", "up", "down")


class StackPlans(Protocol):
    """The pools' attention plans of a forward, built inside the stack's call
    (``PagedAttention.stack_plans``)."""

    layer_args: list[tuple[int, int, int, int]]
    """Per layer what ``native_args`` gives (its pool's args address, segments, keys and
    values addresses)."""
    batch: int
    """Segments."""

    def fill(self, plans: ctypes.Array) -> tuple[int, int]:
        """Fill ``plans`` (one ``StackPlanArgs`` per pool) -> (the segments' int32 array
        address, the number of plans)."""

    def grow(self, index: int) -> None:
        """Plan ``index``'s buffer was too small: make it larger."""

    def planned(self) -> None:
        """The call built every plan: record them."""


def enabled() -> bool:
    return RuntimeEnv.from_environ().native_layers


class NativeLayer:
    """One layer's weights, pointed to once; ``__call__`` runs the layer over a step."""

    def __init__(self, tensors: dict[str, torch.Tensor | PackedRows], layer: LayerArgs) -> None:
        self._tensors = tensors  # keeps every pointer of ``layer`` valid
        self._layer = layer
        self._layer_ref = ctypes.byref(layer)
        self.dtype = tensors["input_norm"].dtype
        """The activations' dtype."""
        sizes = [m.n * m.k for name in MATRICES if isinstance(m := tensors.get(name), PackedRows)]
        self.max_tokens = (
            max_rows_beside_onednn(max(sizes)) if layer.round_once and sizes else MAX_TOKENS
        )
        """The most tokens of a step this layer takes (larger steps: the torch layers);
        beside oneDNN, what its largest matrix takes the panels for."""

    @classmethod
    def build(
        cls,
        weights: dict[str, torch.Tensor | PackedRows | None],
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        act: str,
        eps: float,
        norm_offset: float,
        qk_eps: float,
        round_once: bool = False,
    ) -> NativeLayer | None:
        """weights: ``LayerArgs``'s pointer fields by name: the matrices as ``PackedRows``, norms
        and biases (which may be None) as tensors; round_once: the matmuls' epilogues round
        once, as the oneDNN-packed matmuls they stand in for (``linear.ROUND_ONCE``). None
        when ``layer.c`` cannot run this layer."""
        if not enabled() or library() is None or act not in ACTIVATIONS or act == "none":
            return None
        present = {
            k: w if isinstance(w, PackedRows) else w.detach().contiguous()
            for k, w in weights.items()
            if w is not None
        }
        if any(not isinstance(present.get(k), PackedRows) for k in MATRICES):
            raise TypeError(f"the matrices {MATRICES} are PackedRows (linear.c's layout)")
        # Norm weights are in the activations' dtype, matrices in one format of theirs (bf16
        # under fp32 activations: a bf16 checkpoint's weights, half the bytes to read; int8
        # under either), biases in the matrices' bias dtype.
        norms = {present[k].dtype for k in NORMS if k in present}
        matrices = {present[k].dtype for k in MATRICES}
        biases = {w.dtype for k, w in present.items() if k not in NORMS and k not in MATRICES}
        hidden = present["input_norm"].shape[0]
        if len(norms) != 1 or not norms <= set(DTYPES) or len(matrices) != 1:
            return None
        first = present["qkv"]
        if first.dtype not in WEIGHT_FORMATS or not biases <= {first.bias_dtype}:
            return None
        if first.dtype == torch.float32 and norms != {torch.float32}:
            return None  # bf16 activations read bf16, int8 or int4 matrices, not fp32
        if hidden > MAX_DIM:
            return None
        if head_dim % 2 or head_dim > MAX_DIM or any(not w.is_cpu for w in present.values()):
            return None
        layer = LayerArgs()
        for name, tensor in present.items():
            setattr(layer, name, tensor.data_ptr())
        layer.hidden, layer.intermediate = hidden, present["gate"].n
        layer.heads, layer.kv_heads, layer.head_dim = heads, kv_heads, head_dim
        layer.act = int(ACTIVATIONS[act])
        layer.eps, layer.norm_offset, layer.qk_eps = eps, norm_offset, qk_eps
        layer.w_format = first.format
        layer.round_once = int(round_once)
        return cls(present, layer)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: tuple[int, int, int, int],
    ) -> torch.Tensor:
        """x: [1, T, hidden] (T <= ``MAX_TOKENS``), cos/sin: [1, T, 1, head_dim] contiguous,
        attention: (args address, segments, pool keys address, pool values address) from
        the backend's ``native_args`` -> the layer's output [1, T, hidden] (the step's keys
        and values stored in the pool)."""
        out = x.contiguous().clone()
        step = StepArgs()
        step.x, step.cos, step.sin = out.data_ptr(), cos.data_ptr(), sin.data_ptr()
        step.attn, step.batch, step.k_pool, step.v_pool = attention
        step.tokens = out.shape[0] * out.shape[1]
        step.act_bf16, step.lanes = DTYPES[out.dtype], torch_lanes()
        step.num_threads = small_step_threads()
        status = library().baton_decoder_layer(self._layer_ref, ctypes.byref(step))
        if status != 0:
            raise MemoryError(f"decoder layer kernel: no scratch memory (status {status})")
        return out


class NativeStack:
    """A model's layers as one native call per small step: the embedding's rows, every layer
    (``NativeLayer``'s arithmetic), the final norm -- ``CausalLM.forward`` without a Python
    call per layer."""

    def __init__(
        self,
        layers: list[NativeLayer],
        embed: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        offset: float,
    ) -> None:
        self._layers = layers
        self._embed, self._norm = embed.detach().contiguous(), norm.detach().contiguous()
        self._entries = (StackLayerArgs * len(layers))()
        self._plans = (StackPlanArgs * len(layers))()  # at most a pool per layer
        self._attention: list[tuple[int, int, int, int]] = []  # what the entries hold
        for entry, layer in zip(self._entries, layers, strict=True):
            entry.layer = ctypes.addressof(layer._layer)
        stack = self._stack = StackArgs()
        stack.embed, stack.norm = self._embed.data_ptr(), self._norm.data_ptr()
        stack.layers = ctypes.addressof(self._entries)
        stack.plans = ctypes.addressof(self._plans)
        stack.eps, stack.offset = eps, offset
        stack.num_layers, stack.hidden = len(layers), self._embed.shape[1]
        self.dtype = layers[0].dtype
        self.max_tokens = min(layer.max_tokens for layer in layers)

    @classmethod
    def build(
        cls,
        layers: list[NativeLayer | None],
        embed: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        offset: float,
    ) -> NativeStack | None:
        """None unless every layer is native, of one dtype, and the embedding and norm are in
        it (then ``CausalLM.forward`` runs the step, its layers one by one)."""
        if not layers or any(layer is None for layer in layers):
            return None
        dtype = layers[0].dtype
        if any(layer.dtype != dtype for layer in layers) or embed.dtype != dtype:
            return None
        if norm.dtype != dtype or norm.shape[0] > MAX_DIM or library() is None:
            return None
        return cls(layers, embed, norm, eps, offset)

    def __call__(
        self,
        input_ids: torch.Tensor | Sequence[int],
        positions: torch.Tensor | Sequence[int],
        tables: tuple[torch.Tensor, torch.Tensor],
        attention: list[tuple[int, int, int, int]] | StackPlans,
        head: tuple[PackedRows, torch.Tensor | None, bool] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[int], list[float]] | None:
        """input_ids, positions: [1, T] (T <= ``max_tokens``), tables: the rotary cos and sin
        by position ([rows, head_dim] contiguous, the activations' dtype), attention: per
        layer the backend's ``native_args``, or the pools' plans to build in the same call
        (``StackPlans``) -> final-normed [1, T, hidden] (every layer's keys and values
        stored in its pool); None, with nothing computed or stored, when a position is past
        the tables. input_ids and positions may also be sequences of T ints
        (no tensors made of them): the output is then [T, hidden]. With ``head`` (the head's
        panels, bias, whether it rounds once: ``NativeExecutor.head_kernel``), the same call ends
        with ``logits.head_greedy`` on every row: (output, each row's argmax, its
        log-probability)."""
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids.to(torch.int64).contiguous()
            at = positions.to(torch.int64).contiguous()
            ids_ptr, at_ptr, tokens, shape = ids.data_ptr(), at.data_ptr(), ids.numel(), ids.shape
        else:
            ids, at = array.array("q", input_ids), array.array("q", positions)
            assert len(ids) == len(at)
            (ids_ptr, tokens), (at_ptr, _) = ids.buffer_info(), at.buffer_info()
            shape = (tokens,)
        out = torch.empty((*shape, self._embed.shape[1]), dtype=self.dtype)
        stack = self._stack
        plans = None if isinstance(attention, list) else attention
        if plans is not None:
            stack.segs, stack.num_plans = plans.fill(self._plans)
            stack.batch, attention = plans.batch, plans.layer_args
        else:
            stack.num_plans = 0
        if attention != self._attention:  # a pool's plan keeps its address step after step
            for entry, (args, batch, keys, values) in zip(self._entries, attention, strict=True):
                entry.attn, entry.batch, entry.k_pool, entry.v_pool = args, batch, keys, values
            self._attention = attention
        cos, sin = tables
        assert cos.dtype == sin.dtype == self.dtype and cos.is_contiguous() and sin.is_contiguous()
        stack.ids, stack.out, stack.positions = ids_ptr, out.data_ptr(), at_ptr
        stack.cos, stack.sin, stack.table_rows = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        stack.tokens, stack.act_bf16, stack.lanes = tokens, DTYPES[self.dtype], torch_lanes()
        stack.num_threads = small_step_threads()
        if head is not None:
            weight, bias, round_once = head
            assert weight.k == out.shape[-1] and weight.dtype in WEIGHT_FORMATS
            assert tokens <= MAX_ROWS
            assert bias is None or (bias.dtype == weight.bias_dtype and bias.is_contiguous())
            best, logprob = array.array("q", bytes(8 * tokens)), array.array("f", bytes(4 * tokens))
            stack.head = weight.data_ptr()
            stack.head_bias = None if bias is None else bias.data_ptr()
            stack.best, stack.logprob = best.buffer_info()[0], logprob.buffer_info()[0]
            stack.vocab, stack.head_w_format = weight.n, weight.format
            stack.head_op = ROUND_ONCE if round_once else 0
        else:
            stack.head = None
        status = library().baton_decoder_stack(ctypes.byref(stack))
        while status == 3:  # a plan's buffer too small (nothing computed): grown, again
            plans.grow(stack.failed_plan)
            stack.segs, stack.num_plans = plans.fill(self._plans)
            status = library().baton_decoder_stack(ctypes.byref(stack))
        if status == 4:
            raise AssertionError("a plan needs a unit its request does not hold")
        if status == 2:
            return None
        if plans is not None:
            plans.planned()
        if status != 0:
            raise MemoryError(f"decoder stack kernel: no scratch memory (status {status})")
        return out if head is None else (out, best.tolist(), logprob.tolist())
