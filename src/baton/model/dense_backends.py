"""The attention backends of whole sequences, outside the engine: ``DenseAttention`` (no
cache: training and full-sequence logits) and ``StaticKVCache`` (a contiguous cache per
layer: the reference generator, ``model/reference.py``). Both are also the linear layers'
``RecurrentBackend`` in a hybrid model: ``DenseAttention`` starts every row from the zero
state, ``StaticKVCache`` keeps each row's state between forwards.
"""

from __future__ import annotations

import torch

from baton.model.attention import AttentionBackend, masked_attention, visibility_mask
from baton.model.linear_attention import RecurrentSpan, RecurrentState, whole_rows


class DenseAttention(AttentionBackend):
    """No cache: every row of the batch is one whole sequence at positions 0..T-1.

    Used for training and for full-sequence logits. Linear layers start from the zero state
    and their final state is dropped.
    """

    def __init__(self) -> None:
        self._masks: dict[tuple[int, int | None, torch.device], torch.Tensor] = {}

    def _mask(self, num_tokens: int, window: int | None, device: torch.device) -> torch.Tensor:
        key = (num_tokens, window, device)
        if key not in self._masks:
            pos = torch.arange(num_tokens, device=device)
            self._masks[key] = visibility_mask(pos, pos, window)
        return self._masks[key]

    def attend(self, layer_id, q, k, v, window, scale, softcap):  # noqa: ARG002
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
        num_tokens = q.shape[2]
        mask = (
            None
            if window is None or window >= num_tokens
            else self._mask(num_tokens, window, q.device)
        )
        return masked_attention(q, k, v, mask, scale, softcap).transpose(1, 2)

    def recurrent_spans(self, layer_id: int, batch: int, num_tokens: int) -> list[RecurrentSpan]:  # noqa: ARG002
        return whole_rows(batch, num_tokens, None)

    def store_recurrent_states(
        self, layer_id: int, span: RecurrentSpan, states: dict[int, RecurrentState]
    ) -> None:
        pass


class StaticKVCache:
    """A contiguous K/V cache per layer for a batch of equal-length sequences, and the
    linear layers' recurrent state (hybrid models).

    The slow, obviously-correct reference that the paged engine is compared against. Every
    layer keeps all positions (a sliding layer simply masks the old ones).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        recurrent: dict[int, RecurrentState] | None = None,
    ) -> None:
        """``recurrent``: each linear layer's initial (zero) state, by layer id."""
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len
        self.recurrent = dict(recurrent or {})
        """Each linear layer's state after the ``seq_len`` tokens written, by layer id."""
        self._seq_len = 0

    @property
    def seq_len(self) -> int:
        """Positions already written (the next forward starts here); the caller advances it
        after each forward (``reference.forward_step``), so a rollback is one assignment --
        refused where linear layers hold state (it covers every token it saw)."""
        return self._seq_len

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        if value < self._seq_len and self.recurrent:
            raise ValueError(
                f"cannot roll back from {self._seq_len} to {value} tokens: a linear-attention "
                "layer's recurrent state keeps no history"
            )
        self._seq_len = value

    def step(self) -> _CacheStep:
        """The backend for one forward that continues at ``seq_len``."""
        return _CacheStep(self, self.seq_len)


class _CacheStep(AttentionBackend):
    def __init__(self, cache: StaticKVCache, start: int) -> None:
        self.cache = cache
        self.start = start

    def attend(self, layer_id, q, k, v, window, scale, softcap):
        cache, start = self.cache, self.start
        num_tokens = q.shape[1]
        end = start + num_tokens
        if end > cache.max_len:
            raise ValueError(f"sequence length {end} exceeds the cache's max_len {cache.max_len}")
        cache.k[layer_id][:, :, start:end] = k.transpose(1, 2)
        cache.v[layer_id][:, :, start:end] = v.transpose(1, 2)
        first = 0 if window is None else max(0, end - num_tokens - window + 1)
        keys = cache.k[layer_id][:, :, first:end]
        values = cache.v[layer_id][:, :, first:end]
        q_pos = torch.arange(start, end, device=q.device)
        mask = visibility_mask(q_pos, torch.arange(first, end, device=q.device), window)
        out = masked_attention(q.transpose(1, 2), keys, values, mask, scale, softcap)
        return out.transpose(1, 2)

    def recurrent_spans(self, layer_id: int, batch: int, num_tokens: int) -> list[RecurrentSpan]:
        if layer_id not in self.cache.recurrent:
            raise ValueError(
                f"layer {layer_id} is a linear-attention layer and the cache holds no state "
                "for it: build the cache with reference.new_cache"
            )
        return whole_rows(batch, num_tokens, self.cache.recurrent[layer_id])

    def store_recurrent_states(
        self, layer_id: int, span: RecurrentSpan, states: dict[int, RecurrentState]
    ) -> None:
        held, last = self.cache.recurrent[layer_id], states[max(states)]
        held.conv[span.row], held.recurrent[span.row] = last.conv[0], last.recurrent[0]
