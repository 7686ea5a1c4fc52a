"""Python side of ``linear.c``: ``y = epilogue(x W^T + b)`` for a few rows, weights read once.

The kernel reads a weight packed once into its panels (``PackedRows``: 16 output columns
per contiguous panel; see linear.c). ``linear_rows`` returns None when the kernel cannot
take the call (no kernels, more rows than ``MAX_ROWS``, another dtype, a layout it does not
read, autograd); the caller then runs its torch code, which stays the reference (tests
compare the two). Who calls it: ``baton.model.frozen_linear.FrozenLinear`` (few rows through a
large weight, fp32 or bf16, also where oneDNN packs bf16 for large steps), and
``baton.kernels.layer`` takes its packed weights.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from baton.kernels import DTYPES, library, small_step_threads

MAX_ROWS = 64
"""Up to this many rows (a verification step of 12 requests with 4 draft tokens each) the
panels beat BLAS's fp32 matmul here: 4096x256 at 32 rows 0.88 vs 1.48 ms, a batch-32 decode
step 17-20 vs 22-25 ms (``benchmarks/step_cost.py``). From 32 to 64 (a Zen 5, fp32 steps of
the bundled model, the limit switched every 10 steps in one process): plain decode of 48
requests 1.52x the tokens per second (6 of 6 blocks faster), an MTP batch of 8 (40 rows)
1.07x; with the AVX2 kernels forced (``BATON_CPU_ISA=avx2``) plain 40 / 64 requests 1.32x
/ 1.16x, MTP 8 a tie (0.94-1.00x)."""


MAX_ROWS_BESIDE_ONEDNN = 64
"""Where oneDNN computes bf16 (AVX-512-BF16), the panels take calls of at most this many
rows. Measured on a Zen 5 (bf16 steps of the bundled model, the limit switched every 10
steps in one process): 64 against 32 (oneDNN op by op above): an MTP batch of 8 requests
(40-row verify steps, the draft's first step on 40 pairs in one call) 1.71-1.77x the tokens
per second, 11-12 of 12 blocks faster; of 12 (60 rows) 1.37x; plain decode of 48 / 64
requests 1.22-1.28x / 1.16x. Above 64 oneDNN wins: 128 against 64 for plain 96 / 128
requests 0.80x / 0.77x (an MTP batch of 16, 80 rows, a tie at 1.04x). Earlier sessions
found 32 a tie with 16 for plain batches of 32, and (before the plans, the pair tiles'
tasks and the draft's first step moved into C) 40 rows a tie at 48."""

MAX_ROWS_BESIDE_ONEDNN_LARGE = 8
LARGE_WEIGHT = 1 << 21
"""Beside oneDNN, a weight of at least ``LARGE_WEIGHT`` values (4 MiB in bf16) takes the
panels for at most ``MAX_ROWS_BESIDE_ONEDNN_LARGE`` rows. Measured on a Zen 4 (bf16 decode
steps of Qwen3-0.6B's widths, every matrix >= 2M values, 2 threads, two rounds of separate
processes): batch 16 / 32 with oneDNN above 8 rows 1.16-1.20x / 1.18-1.26x the tokens per
second of the panels up to 64 rows. The bundled model's matrices (at most its 1M-value
head) keep ``MAX_ROWS_BESIDE_ONEDNN``."""


def max_rows_beside_onednn(values: int) -> int:
    """The most rows a weight of ``values`` values takes the panels for where oneDNN packs
    it (bf16 on a CPU with native bf16)."""
    return MAX_ROWS_BESIDE_ONEDNN if values < LARGE_WEIGHT else MAX_ROWS_BESIDE_ONEDNN_LARGE


PANEL = 16
"""Output columns per panel (linear.c's ``PANEL``)."""

WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.quint4x2: 3}
"""A packed weight's dtype -> linear.c's weight format (kernels.h's ``W_*``); int4 weights
are ``torch.quint4x2`` (two 4-bit values per byte), whatever their sign convention."""

INT4_GROUP = 32
"""Inputs per int4 scale (kernels.h's ``INT4_GROUP``)."""


class PackedRows:
    """A ``[n, k]`` weight (torch's Linear layout, fp32 or bf16) in linear.c's panels:
    ``data[b, i, c] = w[16 b + c, i]`` (rows past n are zeros); in bf16 each ``data[b, i]``
    holds columns 0..7 at even positions and 8..15 at odd ones. NOTE: a copy, memory beside
    the weight (which BLAS reads for large steps). ``quantized`` packs int8 weights."""

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.detach()
        n, k = weight.shape
        panels = _panels(weight)
        if weight.dtype == torch.bfloat16:  # column h * 8 + c at position 2 c + h
            panels = panels.reshape(-1, k, 2, PANEL // 2).transpose(2, 3)
        self.data = panels.contiguous().reshape(-1, k, PANEL)
        self.n, self.k, self.dtype = n, k, weight.dtype

    @classmethod
    def quantized(cls, q: torch.Tensor, scale: torch.Tensor) -> PackedRows:
        """An int8 weight ``q`` [n, k] whose row j means ``q[j] * scale[j]`` (fp32 [n]): each
        panel's integers by quads of inputs (k padded with zeros to whole quads; quad j
        holds ``w[16 b + c, 4 j + t]`` at ``[j, c, t]``), then its 16 columns' fp32 scales
        and their int32 sums of the integers (linear.c's ``W_INT8``). A scale of
        [n, groups]: int4 (``_int4``)."""
        n, k = q.shape
        if scale.dim() == 2:
            return cls._int4(q, scale)
        assert q.dtype == torch.int8 and scale.shape == (n,) and scale.dtype == torch.float32
        q = q.detach()
        if k % 4:
            q = torch.cat((q, q.new_zeros(n, -k % 4)), dim=1)
        quads = q.shape[1] // 4
        panels = _panels(q).transpose(1, 2)  # [panels, column, k]
        values = panels.reshape(-1, PANEL, quads, 4).transpose(1, 2).contiguous()
        values = values.reshape(-1, quads * 4 * PANEL)
        scales = _panels(scale.detach().reshape(n, 1)).contiguous().reshape(-1, PANEL)
        sums = _panels(q.sum(dim=1, dtype=torch.int32).reshape(n, 1)).contiguous()
        parts = (values, scales, sums.reshape(-1, PANEL))
        self = cls.__new__(cls)
        self.data = torch.cat([part.view(torch.uint8) for part in parts], dim=1)
        self.n, self.k, self.dtype = n, k, torch.int8
        return self

    @classmethod
    def _int4(cls, q: torch.Tensor, scale: torch.Tensor) -> PackedRows:
        """An int4 weight: ``q`` [n, k] int8 in -8..7 (-7..7 as ``quantize_int4`` makes
        it; -8 too from a checkpoint) whose row j, group g of ``INT4_GROUP``
        inputs means ``q[j, g] * scale[j, g]`` (fp32 [n, groups]), in linear.c's
        ``W_INT4`` panels: per group 4 pairs of quads x 2 halves of 8 columns x 4 bytes,
        quad 2 h + s of a pair in the low (s = 0) or high (s = 1) nibble, as value + 8;
        then the group's 16 column scales."""
        n, k = q.shape
        groups = -(-k // INT4_GROUP)
        assert q.dtype == torch.int8 and scale.shape == (n, groups)
        assert scale.dtype == torch.float32 and int(q.min()) >= -8 and int(q.max()) <= 7
        u = (q.detach().to(torch.int16) + 8).to(torch.uint8)
        u = torch.cat((u, u.new_full((n, groups * INT4_GROUP - k), 8)), dim=1)  # zeros
        u = torch.cat((u, u.new_full((-n % PANEL, u.shape[1]), 8)))
        panels = u.shape[0] // PANEL
        # [panel, half, c, group, h, s, t] -> [panel, group, h, half, c, t, s]
        u = u.reshape(panels, 2, 8, groups, 4, 2, 4).permute(0, 3, 4, 1, 2, 6, 5)
        packed = (u[..., 0] | (u[..., 1] << 4)).reshape(panels, groups, -1)
        s = torch.cat((scale.detach(), scale.new_zeros(-n % PANEL, groups)))
        s = s.reshape(panels, PANEL, groups).transpose(1, 2).contiguous()
        data = torch.cat((packed, s.view(torch.uint8)), dim=2)  # [panel, group, 256 + 64]
        self = cls.__new__(cls)
        self.data = data.reshape(panels, -1).contiguous()
        self.n, self.k, self.dtype = n, k, torch.quint4x2
        return self

    @property
    def format(self) -> int:
        """linear.c's weight format (``WEIGHT_FORMATS``)."""
        return WEIGHT_FORMATS[self.dtype]

    @property
    def bias_dtype(self) -> torch.dtype:
        """The dtype linear.c reads this weight's bias in: bf16 for bf16, else fp32."""
        return torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32

    @property
    def nbytes(self) -> int:
        """The bytes a pass over this weight reads."""
        return self.data.numel() * self.data.element_size()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def int8_rows(self, row0: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[row0, row0 + rows)`` of an int8 / int4 weight as int8 rows for oneDNN's
        int8 matmul (linear.c's ``baton_int8_rows``): (q [rows, k padded to whole quads /
        int4 groups] int8, one fp32 scale per row). int8: the integers and scales as they
        are. int4: requantized to one scale per row, ``s = 8 max_g s_g / 127``, value v of
        group g becoming ``round(v * (s_g / s))`` (ties to even) -- the prompt path's weight,
        within half of s of the int4 value."""
        lib = library()
        assert lib is not None and self.format >= WEIGHT_FORMATS[torch.int8]
        assert row0 >= 0 and row0 + rows <= self.n
        width = self.int8_width
        q = torch.empty(rows, width, dtype=torch.int8)
        scales = torch.empty(rows)
        lib.baton_int8_rows(
            self.data_ptr(),
            self.k,
            self.format,
            row0,
            rows,
            q.data_ptr(),
            width,
            scales.data_ptr(),
            torch.get_num_threads(),
        )
        return q, scales

    def column_scales(self) -> torch.Tensor:
        """An int8 weight's scales [n] (fp32), read from its panels (a view's copy)."""
        assert self.dtype == torch.int8
        at = 64 * (self.int8_width // 4)  # after the panel's values
        return self.data[:, at : at + 64].contiguous().view(torch.float32).reshape(-1)[: self.n]

    @property
    def int8_width(self) -> int:
        """``int8_rows``' row length: k padded to whole quads (int8) or groups (int4)."""
        whole = INT4_GROUP if self.dtype == torch.quint4x2 else 4
        return -(-self.k // whole) * whole

    def dequantize_into(self, out: torch.Tensor, row0: int) -> None:
        """An int8 / int4 weight's rows ``[row0, row0 + len(out))`` as floats into ``out``
        ([rows, k] contiguous, fp32 or bf16; linear.c's ``baton_dequantize_rows``): value
        times its scale in fp32, rounded once to out's dtype."""
        lib = library()
        assert lib is not None and self.format >= WEIGHT_FORMATS[torch.int8]
        assert out.is_contiguous() and out.shape[1] == self.k and out.dtype in DTYPES
        rows = out.shape[0]
        assert row0 >= 0 and row0 + rows <= self.n
        status = lib.baton_dequantize_rows(
            self.data_ptr(),
            self.k,
            self.format,
            row0,
            rows,
            out.data_ptr(),
            DTYPES[out.dtype],
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"dequantize kernel: no scratch memory for {rows} x {self.k}")

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight (as ``Tensor.index_select``): a float weight's in its
        dtype, exactly; a quantized weight's values in fp32."""
        assert dim == 0
        if self.dtype in (torch.float32, torch.bfloat16):
            panel, column = index.div(PANEL, rounding_mode="floor"), index % PANEL
            if self.dtype == torch.bfloat16:  # column h * 8 + c at position 2 c + h
                column = 2 * (column % (PANEL // 2)) + column // (PANEL // 2)
            return self.data[panel, :, column]
        out = torch.empty(len(index), self.k)
        for i, row in enumerate(index.tolist()):
            self.dequantize_into(out[i : i + 1], row)
        return out

    @property
    def is_cpu(self) -> bool:
        return self.data.is_cpu

    def data_ptr(self) -> int:
        return self.data.data_ptr()


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [panels, k, PANEL] (a view's transpose): rows padded with zeros to whole
    panels."""
    n, k = weight.shape
    pad = -n % PANEL
    if pad:
        weight = torch.cat((weight, weight.new_zeros(pad, k)))
    return weight.reshape(-1, PANEL, k).transpose(1, 2)


class Epilogue(IntEnum):
    """What follows the matmul, on its rounded result (``linear.c``'s ``EPI_*``)."""

    NONE = 0
    ADD = 1
    MUL = 2
    SILU = 3
    GELU_TANH = 4


ROUND_ONCE = 16
"""Or'ed into the epilogue (``linear.c``'s ``EPI_ROUND_ONCE``): it works on the fp32 result
and rounds once, as oneDNN's packed matmul with a post-op does."""


ACTIVATIONS = {
    "none": Epilogue.NONE,
    "silu": Epilogue.SILU,
    "gelu_pytorch_tanh": Epilogue.GELU_TANH,
}
"""``FrozenLinear``'s activation names -> the kernel's epilogue."""


def takes(
    x: torch.Tensor, weight: PackedRows, bias: torch.Tensor | None, max_rows: int | None = MAX_ROWS
) -> bool:
    """Whether linear.c takes ``x`` ([..., k]: at most ``max_rows`` rows of k (None: any),
    contiguous, no autograd) through ``weight`` and ``bias`` (its dtype, contiguous),
    kernels loaded aside -- ``linear_rows``' checks, and those of the calls built on it
    (``logits.head_greedy``)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    many = max_rows is not None and rows > max_rows
    if rows == 0 or many or x.dtype not in DTYPES or weight.dtype not in WEIGHT_FORMATS:
        return False  # NOTE: called for every matmul of every step: cheapest checks first
    if not (x.is_contiguous() and weight.is_cpu) or weight.k != k:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return bias is None or (bias.dtype == weight.bias_dtype and bias.is_contiguous())


def linear_rows(
    x: torch.Tensor,
    weight: PackedRows,
    bias: torch.Tensor | None,
    op: Epilogue = Epilogue.NONE,
    other: torch.Tensor | None = None,
    round_once: bool = False,
    max_rows: int | None = MAX_ROWS,
    threads: int | None = None,
) -> torch.Tensor | None:
    """x: [..., k] (rows of k contiguous, at most ``max_rows``; None: any), weight: [n, k]
    packed, other (``ADD``/``MUL``): x's shape with n last -> new [..., n] in x's dtype, or
    None. round_once: the epilogue on the fp32 result, one rounding (see ``ROUND_ONCE``).
    threads: at most this many (default ``small_step_threads``; linear.c sizes the call by
    its work)."""
    if not takes(x, weight, bias, max_rows) or (lib := library()) is None:
        return None
    k, n = x.shape[-1], weight.n
    rows = x.numel() // k
    if other is not None:
        if other.dtype != x.dtype or other.shape[:-1] != x.shape[:-1] or other.shape[-1] != n:
            return None
        other = other.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    status = lib.baton_linear_rows(
        x.data_ptr(),
        k,
        rows,
        k,
        weight.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        None if other is None else other.data_ptr(),
        n,
        int(op) | (ROUND_ONCE if round_once else 0),
        y.data_ptr(),
        n,
        DTYPES[x.dtype],
        weight.format,
        small_step_threads() if threads is None else threads,
    )
    if status != 0:
        raise MemoryError(f"linear kernel: no scratch memory for {rows} x {k} (status {status})")
    return y
