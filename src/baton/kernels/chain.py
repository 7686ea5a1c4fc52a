"""Python side of ``chain.c``: a draft's top-1 proposal chain in one native call.

``NativeChain.build`` takes the tensors the chain reads -- the draft's layer (a
``NativeLayer``), its two input norms and projection, the target's embedding, final norm and
head -- and returns None where ``chain.c`` does not apply (no kernels, a matmul the few-row
kernel does not take, an embedding scale). Who calls it: ``baton.speculative.proposer``,
whose per-step torch path stays the reference (tests compare guesses and the pool's bytes).
"""

from __future__ import annotations

import array
import ctypes
from dataclasses import dataclass

import torch

from baton.kernels import DTYPES, library, small_step_threads
from baton.kernels.layer import NativeLayer
from baton.kernels.linear import ROUND_ONCE, WEIGHT_FORMATS, PackedRows
from baton.kernels.norm import MAX_DIM, torch_lanes

_ptr, _i32, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class _Chain(ctypes.Structure):
    # Field for field the ``Chain`` struct of chain.c.
    _fields_ = [
        *(
            (name, _ptr)
            for name in (
                "layer",
                "embed",
                "enorm",
                "hnorm",
                "norm",
                "eh",
                "eh_bias",
                "head",
                "head_bias",
            )
        ),
        *(
            (name, _i32)
            for name in (
                "vocab",
                "hidden",
                "eh_w_format",
                "head_w_format",
                "eh_op",
                "head_op",
            )
        ),
        *((name, _f32) for name in ("eps", "offset", "norm_eps", "norm_offset")),
    ]


class _ChainStep(ctypes.Structure):
    # Field for field the ``ChainStep`` struct of chain.c.
    _fields_ = [
        *(
            (name, _ptr)
            for name in (
                "hidden",
                "cos",
                "sin",
                "k_pool",
                "v_pool",
                "attn",
                "floor",
                "tokens",
                "first_hidden",
                "first_ids",
                "first_positions",
                "first_attn",
                "last_rows",
            )
        ),
        *(
            (name, _i32)
            for name in (
                "pairs",
                "batch",
                "steps",
                "act_bf16",
                "lanes",
                "num_threads",
                "table_rows",
            )
        ),
    ]


@dataclass
class FirstStep:
    """The chain's first draft step, on each request's pending pairs: their target states
    [pairs, hidden], tokens and rotary positions ([pairs] each), the backend's
    ``native_args`` of their segments, and each request's last pair's index (the state its
    first guess reads)."""

    hidden: torch.Tensor
    token_ids: list[int]
    positions: list[int]
    attention: tuple[int, int, int, int]
    last_rows: list[int]


Matmul = tuple[PackedRows, torch.Tensor | None, bool]
"""A matrix as ``linear.c`` reads it: panels, bias (or None), whether it rounds once."""


class NativeChain:
    """The chain's weights, pointed to once; ``__call__`` runs a chain over a batch."""

    def __init__(self, layer: NativeLayer, keep: list, chain: _Chain, max_rows: int) -> None:
        self._layer, self._keep = layer, keep  # keep every pointer of ``chain`` valid
        self._chain_ref = ctypes.byref(chain)
        self.dtype = layer.dtype
        self._hidden = chain.hidden
        self.max_rows = max_rows
        """The most requests a call takes: the layer's and the matmuls' few-row limit (above
        it the per-step path runs oneDNN's / BLAS's matmuls)."""

    @classmethod
    def build(
        cls,
        layer: NativeLayer | None,
        *,
        embed: torch.Tensor,
        enorm: torch.Tensor,
        hnorm: torch.Tensor,
        norm: torch.Tensor,
        eh: Matmul | None,
        head: Matmul | None,
        max_rows: int,
        eps: float,
        offset: float,
        norm_eps: float,
        norm_offset: float,
    ) -> NativeChain | None:
        """embed [vocab, hidden] and the norms' weights [hidden] in the activations' dtype
        (``layer.dtype``); eh: the draft's projection of cat(e, h), head: the target's."""
        if layer is None or eh is None or head is None or library() is None:
            return None
        tensors = [t.detach().contiguous() for t in (embed, enorm, hnorm, norm)]
        if any(t.dtype != layer.dtype or not t.is_cpu for t in tensors):
            return None
        hidden = tensors[0].shape[1]
        if hidden > MAX_DIM or eh[0].k != 2 * hidden or head[0].k != hidden:
            return None
        if eh[0].n != hidden or head[0].n != tensors[0].shape[0]:
            return None
        chain = _Chain()
        chain.layer = ctypes.addressof(layer._layer)
        for name, t in zip(("embed", "enorm", "hnorm", "norm"), tensors, strict=True):
            setattr(chain, name, t.data_ptr())
        keep = [*tensors]
        for name, (weight, bias, round_once) in (("eh", eh), ("head", head)):
            if weight.dtype not in WEIGHT_FORMATS or (
                bias is not None and bias.dtype != weight.bias_dtype
            ):
                return None
            setattr(chain, name, weight.data_ptr())
            setattr(chain, f"{name}_bias", None if bias is None else bias.data_ptr())
            setattr(chain, f"{name}_w_format", weight.format)
            setattr(chain, f"{name}_op", ROUND_ONCE if round_once else 0)
            keep += [weight, bias]
        chain.vocab, chain.hidden = head[0].n, hidden
        chain.eps, chain.offset = eps, offset
        chain.norm_eps, chain.norm_offset = norm_eps, norm_offset
        return cls(layer, keep, chain, max_rows)

    def __call__(
        self,
        batch: int,
        steps: int,
        tables: tuple[torch.Tensor, torch.Tensor],
        attention: tuple[int, int, int, int],
        floors: list[int],
        hidden: torch.Tensor | None = None,
        first: FirstStep | None = None,
    ) -> list[list[int]] | None:
        """Each of ``batch`` requests' ``steps`` guesses (the scratch slots' keys and values
        stored): from ``hidden`` ([batch, hidden], the first draft step's final-normed
        states), or running the first step here (``first``: exactly one of the two). tables:
        the rotary cos and sin by position ([rows, head_dim] contiguous, the activations'
        dtype; a scratch slot's position is the slot + 1); attention: the backend's
        ``native_args`` of a plan of segments of ``steps - 1`` tokens
        (``PagedAttention(..., one_at_a_time=True)``); floors: per request its lowest
        readable slot. None, with nothing computed or stored, when a position is past the
        tables."""
        assert 0 < batch <= self.max_rows and steps >= 2 and (hidden is None) != (first is None)
        # NOTE: no tensors made but the first step's states' copy: the chain's states are the
        # kernel's scratch with ``first`` (every torch call of a decode step pays for its
        # dispatcher's data coming back into the caches).
        state = None
        if hidden is not None:
            assert hidden.shape == (batch, self._hidden) and hidden.dtype == self.dtype
            state = hidden.clone(memory_format=torch.contiguous_format)
        tokens = array.array("q", bytes(8 * batch * steps))
        cos, sin = tables
        assert cos.dtype == sin.dtype == self.dtype and cos.is_contiguous() and sin.is_contiguous()
        keep = [array.array("i", floors)]
        step = _ChainStep()
        step.hidden = None if state is None else state.data_ptr()
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.table_rows = cos.shape[0]
        step.attn, _, step.k_pool, step.v_pool = attention
        step.floor, step.tokens = keep[0].buffer_info()[0], tokens.buffer_info()[0]
        if first is not None:
            assert first.hidden.dtype == self.dtype and len(first.last_rows) == batch
            first_hidden = first.hidden
            if not first_hidden.is_contiguous():
                first_hidden = first_hidden.contiguous()
            keep += [
                first_hidden,
                array.array("q", first.token_ids),
                array.array("q", first.positions),
                array.array("i", first.last_rows),
            ]
            step.first_hidden = first_hidden.data_ptr()
            step.first_ids, step.first_positions, step.last_rows = (
                a.buffer_info()[0] for a in keep[2:]
            )
            step.first_attn = first.attention[0]
            step.pairs = first.hidden.shape[0]
        step.batch, step.steps = batch, steps
        step.act_bf16, step.lanes = DTYPES[self.dtype], torch_lanes()
        step.num_threads = small_step_threads()
        status = library().baton_draft_chain(self._chain_ref, ctypes.byref(step))
        if status == 2:
            return None
        if status != 0:
            raise MemoryError(f"draft chain kernel: no scratch memory (status {status})")
        found = tokens.tolist()
        return [found[r * steps : (r + 1) * steps] for r in range(batch)]
