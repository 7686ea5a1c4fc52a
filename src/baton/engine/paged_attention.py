"""The attention backend of the engine: variable-length requests over the state pools.

A step's tokens are flattened into one row (``[1, num_tokens]``); each request owns a
contiguous segment of it. For every layer and segment the backend reads the cached context
the segment's queries may see from the layer's pool, appends the segment's fresh keys and
values, attends, and only then writes the fresh keys/values back -- read before write, so a
ring row can be overwritten by the same step that last needed it::

    segment: positions [start, start+n)       window W (None = full)
    context: [max(0, start-W+1), start) from the pool   +   [start, start+n) fresh
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.memory.cache import ModelCache
from baton.model.attention import masked_attention, visibility_mask


@dataclass(frozen=True)
class Segment:
    request_id: str
    offset: int
    """Index of the segment's first token in the flattened step."""
    start: int
    """Position of the segment's first token in its request."""
    num_tokens: int
    floor: int = 0
    """No position below this is read from the pool (the draft-state ablation switch)."""


class PagedAttention:
    """``AttentionBackend`` over a ``ModelCache``; one instance per forward."""

    def __init__(self, cache: ModelCache, segments: list[Segment]) -> None:
        self.cache = cache
        self.segments = segments

    def attend(self, layer_id, q, k, v, window, scale, softcap):
        # q: [1, N, heads, D]; k, v: [1, N, kv_heads, D]
        pool, local = self.cache.layer_map[layer_id]
        out = torch.empty_like(q)
        for seg in self.segments:
            rows = slice(seg.offset, seg.offset + seg.num_tokens)
            q_seg, k_seg, v_seg = q[0, rows], k[0, rows], v[0, rows]
            first = 0 if window is None else max(0, seg.start - window + 1)
            first = min(max(first, seg.floor), seg.start)
            if first < seg.start:
                old_k, old_v = pool.read(local, seg.request_id, first, seg.start)
                keys, values = torch.cat((old_k, k_seg)), torch.cat((old_v, v_seg))
            else:
                keys, values = k_seg, v_seg
            end = seg.start + seg.num_tokens
            if seg.num_tokens == 1:
                mask = None  # one query sees its whole context: no mask needed
            else:
                q_pos = torch.arange(seg.start, end)
                mask = visibility_mask(q_pos, torch.arange(first, end), window)
            attn = masked_attention(
                q_seg.transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                mask,
                scale,
                softcap,
                causal=False,
            )
            out[0, rows] = attn[0].transpose(0, 1)
            pool.write(local, seg.request_id, seg.start, k_seg, v_seg)
        return out
