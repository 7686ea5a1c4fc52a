"""``NativeExecutor``: the native fast paths over a fused ``CausalLM`` and its MTP draft.

The modules (``decoder.CausalLM``, ``draft.MTPDraft``) are plain torch: one ``forward``
each, the reference path. What runs faster on a CPU lives here, beside them, and is chosen
by the engine's runner and proposer, never by the modules:

- each decoder layer as one native call for small steps (``native_layer``: norms, q|k|v,
  q/k norm + rotary, paged attention, o_proj, the MLP -- ``kernels/layer.c``), run by
  ``run_layer`` in place of the module's ``forward``;
- the target's layers and final norm as one native call for small steps (``NativeStack``:
  embedding rows, every layer's ``NativeLayer``, the final norm), given tensors
  (``forward``) or lists (``forward_listed``, which a decode step uses: no tensor made);
  where some layer has no native call, or the embedding is scaled, the layers one by one;
- the head's greedy epilogue in the same call (``logits.head_greedy``: each row's argmax and
  log-probability), where the head takes linear.c's panels (``head_kernel``);
- the MTP draft's forward with its layer's native call, and its whole top-1 proposal chain as
  one call (``DraftExecutor``; the chain is ``kernels/chain.c``).

Each declines (None, nothing computed) where it does not apply -- a backend without native
attention, too many tokens, sandwich norms, an embedding scale -- and the module's
``forward`` is then the path. Tests compare every fast path with its reference bit for bit
(docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import torch

from baton.kernels.chain import NativeChain
from baton.kernels.layer import NativeLayer, NativeStack
from baton.model.attention import AttentionBackend
from baton.model.decoder import CausalLM, DecoderLayer
from baton.model.draft import MTPDraft

Rotary = tuple[torch.Tensor, torch.Tensor]


def native_layer(layer: DecoderLayer) -> NativeLayer | None:
    """After ``fuse_projections``: the whole layer as one native call for small steps
    (``baton.kernels.layer``), where the kernels cover it -- pre-norm layers, with Qwen3's
    q/k norms or none (Llama, Qwen2, Mistral); bf16 or fp32 (bf16 weights oneDNN packs for
    large steps are read from linear.c's panels here too); else None (a linear-attention
    layer, Qwen3.5's gated attention: the kernel has no recurrence, output gate or partial
    rotary; Gemma2's sandwich norms)."""
    if layer.self_attn is None:
        return None
    attn, mlp = layer.self_attn.native_weights(), layer.mlp.native_weights()
    if layer.sandwich_norm or attn is None or mlp is None:
        return None
    norms = {
        "input_norm": layer.input_layernorm.weight,
        "post_norm": layer.post_attention_layernorm.weight,
    }
    a = layer.self_attn
    return NativeLayer.build(
        {**norms, **attn, **mlp},
        heads=a.num_heads,
        kv_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        act=layer.mlp.act_name,
        eps=layer.input_layernorm.eps,
        norm_offset=layer.input_layernorm.offset,
        qk_eps=a.q_norm.eps if a.q_norm is not None else 0.0,
        round_once=layer.mlp.rounds_once,
    )


def layer_attention(layer: DecoderLayer, attn: AttentionBackend) -> tuple | None:
    """The backend's ``native_args`` for ``layer``'s attention (what its native call or a
    draft chain reads), or None where it has none."""
    found = attn.native_args([layer.attention_spec])
    return None if found is None else found[0]


def run_layer(
    layer: DecoderLayer,
    native: NativeLayer | None,
    x: torch.Tensor,
    rotary: Rotary,
    attn: AttentionBackend,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``layer(x, rotary, attn, rows)``: in ``native``'s one call where it takes the step
    (few enough tokens, its dtype, contiguous rotary rows, a backend with native attention),
    else by the module."""
    if native is not None and x.shape[0] * x.shape[1] <= native.max_tokens:
        cos, sin = rotary
        fits = x.dtype == native.dtype and cos.dtype == x.dtype
        if fits and cos.is_contiguous() and sin.is_contiguous():
            args = layer_attention(layer, attn)
            if args is not None:
                out = native(x, cos, sin, args)
                return out if rows is None else out[:, rows]
    return layer(x, rotary, attn, rows)


class NativeExecutor:
    """A fused ``CausalLM``'s native stack and greedy head (built once, after
    ``fuse_projections``)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.layers = [native_layer(layer) for layer in model.model.layers]
        """Each layer's native call (``native_layer``), or None where it has none."""
        self.stack: NativeStack | None = None
        """Every layer and the final norm as one native call for small steps, or None."""
        norm = model.model.norm
        if model.model.embed_scale == 1.0:
            embed = model.model.embed_tokens.weight
            self.stack = NativeStack.build(self.layers, embed, norm.weight, norm.eps, norm.offset)
        self._rotary = model.model.rotary_emb  # read every step: no module lookups
        # The stack's attention arguments; with a stack every layer is an attention layer.
        self.attention_specs = (
            [layer.attention_spec for layer in model.model.layers] if self.stack is not None else []
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``CausalLM.forward``'s result: in the native stack's one call where it takes the
        step, else its layers one by one (``run_layer``), or by the module where no layer
        has a native call."""
        stack = self.stack
        if stack is not None and input_ids.numel() <= stack.max_tokens:
            out = self._run_stack(stack, input_ids, positions, attn)
            if out is not None:
                return out if rows is None else out[:, rows]
        if not any(self.layers):
            return self.model(input_ids, positions, attn, rows)
        decoder = self.model.model
        x = decoder.embed(input_ids)
        rotary = decoder.rotary_emb(positions, x.dtype)
        last = len(self.layers) - 1
        for i, (layer, native) in enumerate(zip(decoder.layers, self.layers, strict=True)):
            x = run_layer(layer, native, x, rotary, attn, rows if i == last else None)
        return decoder.norm(x)

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
        self,
        stack: NativeStack,
        input_ids: torch.Tensor | list[int],
        positions: torch.Tensor | list[int],
        attn: AttentionBackend,
        head: tuple | None = None,
    ) -> torch.Tensor | tuple | None:
        """``forward`` in one native call (the layers' native calls without a Python call
        per layer, the pools' attention plans built in it where the backend leaves them to
        it; with ``head``, its greedy epilogue too), or None where the backend does not
        allow it."""
        attention = attn.stack_plans(self.attention_specs)
        if attention is None:
            attention = attn.native_args(self.attention_specs)
        if attention is None:
            return None
        rotary = self._rotary
        out = stack(input_ids, positions, rotary.tables(0, stack.dtype), attention, head)
        if out is None:  # a position past the tables: grown, then the same call
            last = positions.max() if isinstance(positions, torch.Tensor) else max(positions)
            tables = rotary.tables(int(last) + 1, stack.dtype)
            out = stack(input_ids, positions, tables, attention, head)
        return out


class DraftExecutor:
    """A fused ``MTPDraft``'s fast paths beside its target: its layer's native call in
    ``forward`` and the whole proposal chain as one call (``chain``)."""

    def __init__(self, draft: MTPDraft, target: CausalLM) -> None:
        self.draft = draft
        self.target = target
        self.layer = native_layer(draft.layer)
        """The draft layer's native call, or None."""
        self.chain = native_chain(draft, target, self.layer)
        """A proposal in one native call (``baton.kernels.chain``), or None."""

    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``draft(target, hidden, next_ids, positions, attn, rows)``, its layer natively
        where ``run_layer`` takes the step."""
        draft = self.draft
        x = draft.layer_input(self.target, hidden, next_ids)
        rotary = draft.rotary_emb(positions, x.dtype)
        return self.target.model.norm(run_layer(draft.layer, self.layer, x, rotary, attn, rows))

    def native_attention(self, attn: AttentionBackend) -> tuple | None:
        """``layer_attention`` of the draft's layer."""
        return layer_attention(self.draft.layer, attn)


def native_chain(
    draft: MTPDraft, target: CausalLM, layer: NativeLayer | None
) -> NativeChain | None:
    """After both models' ``fuse_projections``: a proposal chain as one native call
    (``baton.kernels.chain``: the draft's first step, then per guess the target's head and
    argmax and the draft's step on it; ``layer`` is the draft layer's ``native_layer``), or
    None where it does not apply."""
    eh, head = draft.frozen_eh, target.frozen_head
    if eh is None or head is None or target.model.embed_scale != 1.0:
        return None
    norm = target.model.norm
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
