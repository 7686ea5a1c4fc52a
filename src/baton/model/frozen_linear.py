"""FrozenLinear: the inference matmul every projection of a loaded model runs.

Owns the choice of path per call -- oneDNN's packed bf16 matmul (activation and residual
inside it), ``F.linear``, or ``linear.c``'s few-row kernel (``baton.kernels.linear``) -- as
the contexts of ``matmul_context`` ask (``step_invariant_rows``: a row's result does not
depend on the call's number of rows). Pure torch plus those kernels; holds no parameters of
its own (it reads the module's) and never touches the engine. Who calls it: ``attention``,
``decoder``, ``draft`` and ``layers.GatedMLP`` (built in ``fuse_projections``;
``few_rows_kernel`` / ``few_rows_now`` hand its panels to the native chain and head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton import platform
from baton.kernels import library, prompt_step_threads
from baton.kernels.layer import enabled as native_layers_enabled
from baton.kernels.linear import (
    ACTIVATIONS,
    MAX_ROWS,
    Epilogue,
    PackedRows,
    linear_rows,
    max_rows_beside_onednn,
)
from baton.model.matmul_context import holding_once, in_row_blocks, rows_invariant
from baton.model.quantize import (
    QUANTIZERS,
    QuantizedWeight,
    check_quantization,
    dequantized_linear,
    int8_linear,
)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN's packed bf16 matmul exists on this CPU (``Platform.native_bf16``): elsewhere
    packing raises (``mkldnn_reorder_linear_weight: bf16 path needs ...``) and a bf16 weight
    goes through ``F.linear``, slowly but correctly."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and platform.current().native_bf16
    )


PANELS_FOR_EVERY_STEP = True
"""A float weight oneDNN does not pack (fp32 compute: CPUs without native bf16) is held in
linear.c's panels alone -- bf16 ones where a bf16 checkpoint's values are, so 2 bytes a
weight instead of fp32's 4 for ``F.linear`` plus the panels -- and every call takes
linear.c, prompt chunks too. Measured on a Zen 4 held to AVX2 (``BATON_CPU_ISA=avx2``, MKL
and oneDNN too), 2 threads, Qwen3-1.7B's MLP matrices: 1.09-1.29x MKL's sgemm at 512 rows,
1.2-1.6x at 64, 1.7-2.2x at 16. A row's result does not depend on the call's rows inside
``step_invariant_rows`` (16-row blocks: the kernel's groups of 6, 6 and 4 rows sum every
row alike). Large calls run on torch's OpenMP threads (``kernels.prompt_step_threads``):
on ``pool.c``'s, right after torch's ops, they ran 0.63-0.92x BLAS."""

PANELS_ONLY_MIN_WEIGHT = 1 << 20
"""``PANELS_FOR_EVERY_STEP`` for weights of at least this many values: below it (the bundled
model's 768 x 256 and 256 x 256) MKL's sgemm matched or beat the panels at 496 rows (0.95-1.05x
the panels' time), and a few MB beside the panels do not matter."""

FEW_ROWS_MIN_WEIGHT = 1 << 17
"""Weights of at least this many elements (512 KiB in fp32; the draft's projection of the bundled
model is one) take ``linear_rows`` for few rows."""


class FrozenLinear:
    """An inference-only ``y = act(x W^T + b)``; bf16 weights on CPU are packed once into
    oneDNN's blocked layout, which a plain ``F.linear`` re-derives on every call: measured
    here, a weight-streaming decode GEMV reads 24 vs 18 GB/s, a small one runs in 20 vs 30 us,
    with bitwise-equal results. Packed, the activation and ``mul``/``add``'s elementwise op
    run inside the matmul on its fp32 result (one rounding to bf16 instead of two or three):
    a 4096-token SwiGLU MLP in 13 vs 20 ms. NOTE: memory -- a float weight is held as the
    paths read it and no more: oneDNN's packed copy and linear.c's panels (few rows; their
    rows serve ``effective_weight``) where oneDNN packs, else the weight itself for
    ``F.linear`` and the panels (half its bytes where a bf16 checkpoint computes in fp32);
    the module's own parameter is released (``quantize.release_weights``).

    quantization ``int8`` / ``int4`` (``baton.model.quantize``): the weight is kept quantized
    and nothing else -- with the kernels, only in their packed panels (the integers once):
    few rows read them (any size: every call would otherwise dequantize), more rows run
    W8A8 through oneDNN's int8 matmul (``quantize.int8_linear``; an int4 weight requantized
    to int8 rows per call). Measured on a Zen 4, one thread, bf16: 1.1-1.5x the packed bf16
    matmul at 64-512 rows even for the bundled model's 768 x 256 (1.2-1.7x for 1024-wide
    ones), where dequantizing for BLAS ran 0.7-0.95x. Without the kernels an int8 weight
    takes the same arithmetic in torch ops, an int4 one is dequantized per call."""

    def __init__(
        self,
        weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
        activation: str = "none",
        quantization: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: the compute dtype where the weight (and bias) are bf16 and it is fp32 -- a
        bf16 checkpoint fused before it is widened (``CausalLM.fuse_projections``): the
        panels take the weight as it is (the values ``_narrowed`` finds in the widened one),
        what BLAS reads is widened."""
        narrow = isinstance(weight, torch.Tensor) and dtype not in (None, weight.dtype)
        widen = dtype if narrow else None
        self.bias = None if bias is None else bias.detach()
        if widen is not None and self.bias is not None:
            self.bias = self.bias.to(widen)
        self.activation = activation
        self.quantized: QuantizedWeight | None = None
        if isinstance(weight, QuantizedWeight):  # a pre-quantized checkpoint's, as it is
            self.quantized, weight = weight, None
        elif check_quantization(quantization) is not None:
            self.quantized, weight = QUANTIZERS[quantization](weight), None
        else:
            weight = weight.detach()
        once = weight is not None and holding_once() and self._panels_can_hold(weight)
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            if weight is not None and widen is None and not once and can_pack(weight)
            else None
        )
        self.weight = None if self.packed is not None else weight
        """What ``F.linear`` reads: None when oneDNN's packed copy serves BLAS's calls, or
        the weight is quantized."""
        self._source = weight  # the parameter's own storage, no copy: what ``rows`` packs
        self._post = PACKED_ACTIVATIONS[activation]
        # NOTE: resolved once: the torch.ops lookup and overload dispatch cost microseconds
        # per call, and a decode step makes ~50 of these calls.
        self._unary = torch.ops.mkldnn._linear_pointwise.default
        self._binary_op = torch.ops.mkldnn._linear_pointwise.binary
        self._rows: tuple[PackedRows, torch.Tensor | None] | None = None
        # Few rows through a weight this big: linear.c reads it once for all of them (BLAS
        # takes 2-4x a row's time for 2-8 rows); below it the call's fixed cost dominates.
        self.quantization = None if self.quantized is None else self.quantized.method
        """``int8`` / ``int4``, or None: the weight as loaded."""
        self._few_rows = native_layers_enabled() and (
            self.quantization is not None or weight.numel() >= FEW_ROWS_MIN_WEIGHT
        )
        self._max_few_rows = (
            max_rows_beside_onednn(weight.numel()) if self.packed is not None else MAX_ROWS
        )
        if self.quantization is not None and self._few_rows and library() is not None:
            self.rows()  # packed now: from here on the panels alone hold the integers
            self.quantized = None
        elif self.packed is not None and self.rows() is not None:
            # oneDNN's copy serves every call the panels do not, and the panels give rows
            # of the weight (``effective_weight``): the float weight itself is no longer
            # read -- two copies where there were three (the module releases its own).
            self._source = None
        elif self._panels_can_hold(weight) and self.rows() is not None:
            # Not packed (fp32 compute): the panels serve every call, large steps too
            self.weight = self._source = None
        if widen is not None and self.weight is not None:
            self.weight = self._source = self.weight.to(widen)  # for BLAS (and ``rows``)

    @staticmethod
    def _panels_can_hold(weight: torch.Tensor) -> bool:
        """A float weight linear.c's panels would hold alone where oneDNN does not pack it."""
        return (
            PANELS_FOR_EVERY_STEP
            and weight.numel() >= PANELS_ONLY_MIN_WEIGHT
            and native_layers_enabled()
            and library() is not None
        )

    def share(self, weight: torch.Tensor) -> None:
        """Read ``weight`` -- the same values, held anyway (a head tied to the embedding it
        was fused before: ``CausalLM.fuse_projections``) -- in place of BLAS's own copy."""
        if self.weight is not None:
            assert weight.shape == self.weight.shape and weight.dtype == self.weight.dtype
            self.weight = self._source = weight.detach()

    @property
    def rounds_once(self) -> bool:
        """The epilogue works on the fp32 result and rounds once (oneDNN's packed path);
        else the result rounds, then each epilogue op (``F.linear`` and torch ops)."""
        return self.packed is not None

    @property
    def panels_only(self) -> bool:
        """A float weight held only in linear.c's panels: every call, a prompt chunk's too,
        runs ``linear.c`` (``PANELS_FOR_EVERY_STEP``)."""
        return self.quantization is None and self.packed is None and self._source is None

    @property
    def _quantized_panels_only(self) -> bool:
        """A quantized weight in the panels on a CPU whose oneDNN int8 matmul is not exact
        (no VNNI: ``Platform.exact_int8_matmul``): every call, a prompt chunk's too, runs
        linear.c's W8A8 / W4A8 -- exact integer sums, the small steps' function at any size.
        On the AVX2 stand-in (0.6B, 512-token prefill) 1.22x the fp32 model, where
        ``int8_linear``'s exact fp32 products ran 0.80x."""
        return (
            self.quantization is not None
            and self.quantized is None
            and self._rows is not None
            and not platform.current().exact_int8_matmul
        )

    def rows(self) -> tuple[PackedRows, torch.Tensor | None] | None:
        """What the native kernels read (``linear.c``'s packed weight, and its bias), packed
        on first use (a float weight oneDNN packs: at construction, then the weight itself
        is dropped); None with native layers off. NOTE: where oneDNN packs bf16 too (it
        serves large steps) this is a second copy of the weight, for small steps (a batch-1
        step 0.48 vs 1.53 ms op by op through oneDNN on a Zen 5, ``benchmarks/step_cost.py``)."""
        if self._rows is None and native_layers_enabled():
            if self.quantized is not None:  # linear.c reads an int8 weight's bias in fp32
                q, bias = self.quantized, None if self.bias is None else self.bias.float()
                self._rows = (PackedRows.quantized(q.q, q.scale), bias)
            else:
                weight, bias = self._narrowed()
                self._rows = (PackedRows(weight), bias)
        return self._rows

    def few_rows_kernel(self) -> tuple[PackedRows, torch.Tensor | None, bool] | None:
        """For a native caller that runs this matmul as ``__call__`` does on at most
        ``max_few_rows`` rows (``baton.kernels.chain``): panels, bias and whether it rounds
        once; None where ``__call__`` does not take ``linear.c`` (a small weight, an
        activation, native layers off)."""
        if not self._few_rows or self.activation != "none":
            return None
        rows = self.rows()
        return None if rows is None else (*rows, self.rounds_once)

    def few_rows_now(self, rows: int) -> tuple[PackedRows, torch.Tensor | None, bool] | None:
        """``few_rows_kernel`` where ``__call__`` would take linear.c for ``rows`` rows now
        (at most ``max_few_rows``, outside ``step_invariant_rows``); else None."""
        if rows_invariant() or rows > self._max_few_rows:
            return None
        return self.few_rows_kernel()

    @property
    def max_few_rows(self) -> int:
        return self._max_few_rows

    def _narrowed(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias ``rows`` packs: as they are, or -- an fp32 weight whose every
        value is a bf16 value, as a bf16 checkpoint loaded in fp32 is -- in bf16: the same
        numbers in half the bytes, and a small step is a pass over its weights."""
        weight, bias = self._source, self.bias
        if weight.dtype != torch.float32:  # (a bf16 weight's bias in bf16: exact, see dtype)
            return weight, None if bias is None else bias.to(weight.dtype)
        narrow = weight.to(torch.bfloat16)
        if not torch.equal(narrow.float(), weight):
            return weight, bias
        if bias is not None:
            narrow_bias = bias.to(torch.bfloat16)
            if not torch.equal(narrow_bias.float(), bias):
                return weight, bias
            return narrow, narrow_bias
        return narrow, None

    @property
    def _rows_exact(self) -> bool:
        """Every call takes linear.c's W8A8 (``_quantized_panels_only``, int8): each row's
        sums are exact integers and its epilogue its own, so a row's bits never depend on
        the call's number of rows -- ``step_invariant_rows`` needs no padding (a prompt of
        8 tokens is not computed as 16)."""
        return self.quantization == "int8" and self._quantized_panels_only

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if rows_invariant():
            return self._blas(x) if self._rows_exact else in_row_blocks(self._blas, x)
        if self._few_rows and self._takes_few(x):
            weight, bias = self.rows()
            y = linear_rows(x, weight, bias, ACTIVATIONS[self.activation], None, self.rounds_once)
            if y is not None:
                return y
        return self._blas(x)

    def _takes_few(self, x: torch.Tensor) -> bool:
        return x.numel() <= self._max_few_rows * x.shape[-1]

    def _blas(self, x: torch.Tensor) -> torch.Tensor:
        """``__call__`` through oneDNN: the packed bf16 matmul, the int8 one (a quantized
        weight: ``int8_linear``), or ``F.linear`` (a float weight not packed; an int4 one
        without the kernels, dequantized for this call in x's dtype)."""
        if self.packed is not None:
            attr, algo = self._post
            return self._unary(x, self.packed, self.bias, attr, [], algo)
        if self.panels_only or self._quantized_panels_only:
            return self._panels(x, ACTIVATIONS[self.activation], None)
        if self.quantization is not None:
            weight = self.effective_weight
            if self.quantization == "int8" or isinstance(weight, PackedRows):
                return ACT_FNS[self.activation](int8_linear(x, weight, self.bias))
            return ACT_FNS[self.activation](dequantized_linear(x, weight, self.bias))
        return ACT_FNS[self.activation](F.linear(x, self.weight, self.bias))

    def _panels(self, x: torch.Tensor, op: Epilogue, other: torch.Tensor | None) -> torch.Tensor:
        """Any number of rows through the panels, on torch's OpenMP threads (as BLAS would
        run: ``kernels.prompt_step_threads``)."""
        weight, bias = self._rows
        if x.numel() == 0:
            return x.new_empty((*x.shape[:-1], weight.n))
        threads = prompt_step_threads()
        y = linear_rows(x.contiguous(), weight, bias, op, other, max_rows=None, threads=threads)
        assert y is not None, "linear.c takes every call of a panels-only weight"
        return y

    @property
    def effective_weight(self) -> torch.Tensor | QuantizedWeight:
        """The weight this matmul multiplies by: the float weight, or the panels where
        they are the only other copy beside oneDNN's, or the quantized one (a
        ``QuantizedWeight``, or the panels holding it): ``index_select(0, ids)`` gives rows
        of its values for each."""
        if self.quantization is None and self._source is not None:
            return self._source
        return self.quantized if self.quantized is not None else self._rows[0]

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) * other`` (no activation)."""
        return self._binary(x, other, "mul")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) + other`` (no activation): a residual added inside the matmul."""
        return self._binary(x, other, "add")

    def _binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        assert self.activation == "none", "a binary op follows the bare matmul"
        if rows_invariant():
            if other.shape[:-1] == x.shape[:-1]:
                if self._rows_exact:
                    return self._binary_blas(x, other, op)
                return in_row_blocks(lambda a, b: self._binary_blas(a, b, op), x, other)
            y = self(x)
            return y * other if op == "mul" else y + other
        if self._few_rows and self._takes_few(x):
            epilogue = Epilogue.MUL if op == "mul" else Epilogue.ADD
            weight, bias = self.rows()
            y = linear_rows(x, weight, bias, epilogue, other, self.rounds_once)
            if y is not None:
                return y
        return self._binary_blas(x, other, op)

    def _binary_blas(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        fused = other.dtype == x.dtype and other.shape[:-1] == x.shape[:-1]  # inside the matmul
        if fused and self.packed is not None:
            return self._binary_op(x, other.contiguous(), self.packed, self.bias, op)
        if fused and (self.panels_only or self._quantized_panels_only):
            return self._panels(x, Epilogue.MUL if op == "mul" else Epilogue.ADD, other)
        y = self._blas(x)
        return y * other if op == "mul" else y + other


ACT_FNS = {
    "none": lambda x: x,
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
PACKED_ACTIVATIONS = {
    "none": ("none", ""),
    "silu": ("swish", ""),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
}
"""oneDNN post-op (attr, algorithm) of each activation, for packed ``FrozenLinear``."""
