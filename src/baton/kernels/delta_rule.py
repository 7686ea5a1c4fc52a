"""Python side of ``delta_rule.c``: a gated delta net's sequence core token by token.

``gated_delta_steps`` returns None where the kernel cannot take the call (no kernels,
sizes past its buffers); the caller then runs its torch code,
which stays the reference (tests compare the two at every level). Who calls it:
``baton.model.linear_attention.GatedDeltaNet`` for the engine's spans.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from baton.kernels import library


def gated_delta_steps(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    params: tuple[torch.Tensor, ...],
    conv_state: torch.Tensor,
    state: torch.Tensor,
    heads: tuple[int, int, int, int],
    at: Collection[int],
    bf16: bool,
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None:
    """One sequence's T tokens: x [T, C] (q|k|v projections), a, b [T, Hv]; params: the
    conv's weight [C, K], A_log and dt_bias [Hv], fp32 contiguous; the state before them
    (conv [C, K-1], recurrent [Hv, dk, dv], fp32, left as they are); heads = (Hk, Hv, dk,
    dv); ``bf16``: the conv's output rounded to bf16 -> (o [T, Hv, dv] fp32, {t: (conv,
    recurrent) after token t} for t in ``at``)."""
    lib = library()
    if lib is None:
        return None
    hk, hv, dk, dv = heads
    num_tokens, channels = x.shape
    taps = params[0].shape[-1]
    inputs = [t.float().contiguous() for t in (x, a, b)]
    conv = conv_state.clone(memory_format=torch.contiguous_format)
    held = state.clone(memory_format=torch.contiguous_format)
    out = torch.empty(num_tokens, hv, dv)
    wanted = sorted(t for t in set(at) if 0 <= t < num_tokens)
    keep = torch.zeros(num_tokens, dtype=torch.uint8)
    keep[wanted] = 1
    saved_conv = torch.empty(len(wanted), channels, taps - 1)
    saved = torch.empty(len(wanted), hv, dk, dv)
    code = lib.baton_gated_delta_steps(
        *(t.data_ptr() for t in (*inputs, *params, conv, held, out)),
        num_tokens,
        channels,
        taps,
        hk,
        hv,
        dk,
        dv,
        int(bf16),
        keep.data_ptr(),
        saved_conv.data_ptr(),
        saved.data_ptr(),
    )
    if code != 0:
        return None
    return out, {t: (saved_conv[i], saved[i]) for i, t in enumerate(wanted)}
