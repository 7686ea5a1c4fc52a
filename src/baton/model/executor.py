"""``NativeExecutor``: the native fast paths over a fused ``CausalLM`` and its MTP draft.

The modules (``decoder.CausalLM``, ``draft.MTPDraft``) are plain torch: one ``forward``
each, the reference path. What runs faster on a CPU lives here, beside them, and is chosen
by the engine's runner and proposer, never by the modules:

- the target's layers and final norm as one native call for small steps (``NativeStack``:
  embedding rows, every layer's ``NativeLayer``, the final norm), given tensors
  (``forward``) or lists (``forward_listed``, which a decode step uses: no tensor made);
- the head's greedy epilogue in the same call (``logits.head_greedy``: each row's argmax and
  log-probability), where the head takes linear.c's panels (``head_kernel``);
- the draft's whole top-1 proposal chain as one call (``native_chain``: ``kernels/chain.c``).

Each declines (None, nothing computed) where it does not apply -- a backend without native
attention, too many tokens, sandwich norms, an embedding scale -- and the module's
``forward`` is then the path. Tests compare every fast path with its reference bit for bit
(docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import torch

from baton.kernels.chain import NativeChain
from baton.kernels.layer import NativeStack
from baton.model.attention import AttentionBackend
from baton.model.decoder import CausalLM
from baton.model.draft import MTPDraft


class NativeExecutor:
    """A fused ``CausalLM``'s native stack and greedy head (built once, after
    ``fuse_projections``)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.attention_specs = [layer.attention_spec for layer in model.model.layers]
        self.stack: NativeStack | None = None
        """Every layer and the final norm as one native call for small steps, or None."""
        norm = model.model.norm
        if model.model.embed_scale == 1.0:
            self.stack = NativeStack.build(
                [layer.native for layer in model.model.layers], model.model.embed_tokens.weight,
                norm.weight, norm.eps, norm.offset,
            )  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``CausalLM.forward``'s result, in the native stack's one call where it takes the
        step, else by the module."""
        stack = self.stack
        if stack is not None and input_ids.numel() <= stack.max_tokens:
            out = self._run_stack(stack, input_ids, positions, attn)
            if out is not None:
                return out if rows is None else out[:, rows]
        return self.model(input_ids, positions, attn, rows)

    def forward_listed(
        self,
        input_ids: list[int],
        positions: list[int],
        attn: AttentionBackend,
        greedy_head: bool = False,
    ) -> tuple[torch.Tensor, tuple[list[int], list[float]] | None] | None:
        """``forward`` of one row of T tokens given as lists (a ``[1, T]`` tensor's values)
        -> (final-normed [T, hidden], None), in the native stack's one call without making a
        tensor of them; with ``greedy_head``, where ``head_kernel`` takes the T rows, the
        same call ends with the head's greedy epilogue (``logits.head_greedy``: each row's
        argmax and its log-probability) in place of that None. None, with nothing computed,
        where the stack does not take the step (then ``forward`` runs it)."""
        stack = self.stack
        if stack is None or len(input_ids) > stack.max_tokens:
            return None
        head = self.head_kernel(len(input_ids)) if greedy_head else None
        out = self._run_stack(stack, input_ids, positions, attn, head)
        if out is None or head is None:
            return None if out is None else (out, None)
        hidden, best, logprobs = out
        return hidden, (best, logprobs)

    def head_kernel(self, rows: int) -> tuple | None:
        """What ``baton.kernels.logits.head_greedy`` reads for ``rows`` rows of the model's
        ``head``: (panels, bias, rounds once), where ``head`` itself would take linear.c's
        panels for them and the logits are the raw scores; else None."""
        head = self.model.frozen_head
        if head is None or self.model.spec.final_logit_softcap is not None:
            return None
        return head.few_rows_now(rows)

    def _run_stack(
        self, stack: NativeStack, input_ids: torch.Tensor | list[int],
        positions: torch.Tensor | list[int], attn: AttentionBackend, head: tuple | None = None,
    ) -> torch.Tensor | tuple | None:  # fmt: skip
        """``forward`` in one native call (the layers' native calls without a Python call
        per layer, the pools' attention plans built in it where the backend leaves them to
        it; with ``head``, its greedy epilogue too), or None where the backend does not
        allow it."""
        attention = attn.stack_plans(self.attention_specs)
        if attention is None:
            attention = attn.native_args(self.attention_specs)
        if attention is None:
            return None
        rotary = self.model.model.rotary_emb
        out = stack(input_ids, positions, rotary.tables(0, stack.dtype), attention, head)
        if out is None:  # a position past the tables: grown, then the same call
            last = positions.max() if isinstance(positions, torch.Tensor) else max(positions)
            tables = rotary.tables(int(last) + 1, stack.dtype)
            out = stack(input_ids, positions, tables, attention, head)
        return out


def native_chain(draft: MTPDraft, target: CausalLM) -> NativeChain | None:
    """After both models' ``fuse_projections``: a proposal chain as one native call
    (``baton.kernels.chain``: the draft's first step, then per guess the target's head and
    argmax and the draft's step on it), or None where it does not apply."""
    eh, head = draft.frozen_eh, target.frozen_head
    if eh is None or head is None or target.model.embed_scale != 1.0:
        return None
    layer, norm = draft.layer.native, target.model.norm
    same_norms = (draft.enorm.eps, draft.enorm.offset) == (draft.hnorm.eps, draft.hnorm.offset)
    if layer is None or not same_norms:  # the kernel takes one eps and offset for both
        return None
    return NativeChain.build(
        layer,
        embed=target.model.embed_tokens.weight,
        enorm=draft.enorm.weight,
        hnorm=draft.hnorm.weight,
        norm=norm.weight,
        eh=eh.few_rows_kernel(),
        head=head.few_rows_kernel(),
        max_rows=min(layer.max_tokens, eh.max_few_rows, head.max_few_rows),
        eps=draft.enorm.eps,
        offset=draft.enorm.offset,
        norm_eps=norm.eps,
        norm_offset=norm.offset,
    )
