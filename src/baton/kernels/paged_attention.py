"""Python side of ``paged_attention.c``: one call attends a batch of short segments.

A ``PagedAttentionCall`` per pool (and kind of plan) is planned once per forward from the
segments and their requests' unit tables (natively, into one int32 buffer it keeps) and run
once per layer with that layer's q, output and pool storage. Who calls it:
``baton.model.paged_attention``, whose torch path is the reference.
"""

from __future__ import annotations

import array
import ctypes

import torch

from baton.kernels import DTYPES, library


class _Args(ctypes.Structure):
    # Field for field the ``Args`` struct of paged_attention.c.
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_token_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("out_token_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("unit_stride", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("fresh_k", ctypes.c_void_p),
        ("fresh_v", ctypes.c_void_p),
        ("fk_token_stride", ctypes.c_int64),
        ("fk_head_stride", ctypes.c_int64),
        ("fv_token_stride", ctypes.c_int64),
        ("fv_head_stride", ctypes.c_int64),
        ("units", ctypes.c_void_p),
        ("num_units", ctypes.c_void_p),
        ("key_base", ctypes.c_void_p),
        ("q_offset", ctypes.c_void_p),
        ("q_start", ctypes.c_void_p),
        ("q_count", ctypes.c_void_p),
        ("first", ctypes.c_void_p),
        ("store_token", ctypes.c_void_p),
        ("store_unit", ctypes.c_void_p),
        ("store_row", ctypes.c_void_p),
        ("num_stores", ctypes.c_int32),
        ("max_units", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("is_ring", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("is_bf16", ctypes.c_int32),
        ("kv_int8", ctypes.c_int32),
        ("kv_bf16", ctypes.c_int32),
    ]


class PagedAttentionCall:
    """A pool's batch plan for the kernel, rebuilt in place step after step (``plan``): the
    index lists in one int32 buffer, the ``Args`` struct pointing into it, and the fields
    ``for_layer`` set, which stay as long as the pool and the heads do.
    """

    def __init__(self) -> None:
        self.args = _Args()
        self._address = ctypes.addressof(self.args)
        self._buffer = array.array("i")
        self._tables = array.array("q")  # ``prepare``'s unit table addresses and lengths
        self._held: list[array.array] = []  # and the tables themselves
        self._lengths = array.array("i")
        self.batch = 0
        self.generation = 0
        """How many plans this call has held: a plan is valid while it is the latest."""
        self._layer_storage: torch.Tensor | None = None  # ``for_layer``'s last pool
        self._layer_fields: tuple = ()
        self._layer_strides = (0, 0)

    def plan(
        self,
        tables: list[array.array],
        segments: list[tuple[int, int, int, int]],
        rows: int,
        window: int | None,
        keep: int,
        is_ring: bool,
        covers_own: bool = False,
    ) -> int:
        """Build the lists natively (``baton_paged_plan``) from each segment's unit table;
        returns the plan's ``generation``. tables: per segment its request's units by
        logical index (-1: none held; a ring: its one unit), an int32 ``array``; segments:
        per segment (step token of its first query, that query's position, queries, floor:
        no lower position is read); rows: a unit's rows; window: the layer's (None: full
        attention); keep: of a segment's positions [start, end) those from max(start, end -
        keep) are stored (-1: all); covers_own: the units read cover the segment's own
        positions too (``baton.kernels.chain``'s steps read them from the pool). What the
        lists hold is ``baton_paged_plan``'s comment; the torch path of
        ``baton.model.paged_attention`` computes the same from the pool in Python."""
        flat = array.array("i", [v for segment in segments for v in segment])
        num_queries = sum(count for _, _, count, _ in segments)
        addresses, lengths, buffer, size = self.prepare(tables, num_queries, rows, window, is_ring)
        status = library().baton_paged_plan(
            self._address,
            len(tables),
            addresses,
            lengths,
            flat.buffer_info()[0],
            keep,
            int(covers_own),
            buffer,
            size,
        )
        if status != 0:
            self.generation += 1  # the old plan is gone even though this one failed
            if status == -2:
                raise AssertionError(f"a plan needs a unit its request does not hold: {segments}")
            raise AssertionError(status)  # -1: ``prepare`` sizes the buffer for the most it takes
        return self.planned(len(tables))

    def prepare(
        self,
        tables: list[array.array],
        num_queries: int,
        rows: int,
        window: int | None,
        is_ring: bool,
    ) -> tuple[int, int, int, int]:
        """``plan``'s inputs, for a plan built inside another native call (``NativeStack``:
        ``baton_paged_plan`` there, then ``planned``): the Args fields set, the tables'
        addresses and lengths in arrays this call keeps, the buffer grown to what the plan
        needs at most -> (tables address, lengths address, buffer address, capacity).
        num_queries: the segments' queries in all."""
        batch = len(tables)
        if batch > len(self._lengths):  # grown, never shrunk (a plan points into them)
            self._tables = array.array("q", bytes(8 * 2 * batch))
            self._lengths = array.array("i", bytes(4 * 2 * batch))
        addresses, lengths = self._tables, self._lengths
        self._held = tables  # alive until the next plan (a ring's table is made per call)
        longest = 0
        for b, table in enumerate(tables):
            addresses[b], lengths[b] = table.buffer_info()
            longest = max(longest, lengths[b])
        capacity = batch * (longest + 6) + 3 * num_queries
        if capacity > len(self._buffer):  # grown, never shrunk (the plan points into it)
            self._buffer = array.array("i", bytes(4 * max(capacity, 2 * len(self._buffer))))
        args = self.args
        args.rows, args.window, args.is_ring = rows, window or 0, int(is_ring)
        buffer, size = self._buffer.buffer_info()
        return addresses.buffer_info()[0], lengths.buffer_info()[0], buffer, size

    @property
    def address(self) -> int:
        """The ``Args`` struct's address (what ``for_layer`` gives first)."""
        return self._address

    def grow(self) -> None:
        """The plan's buffer was too small for what ``prepare`` asked (nothing written):
        twice as large (never shrunk)."""
        self._buffer = array.array("i", bytes(4 * 2 * max(len(self._buffer), 256)))

    def planned(self, batch: int) -> int:
        """A plan of ``batch`` segments was built (by another native call, from ``prepare``'s
        inputs): its ``generation``."""
        self.generation += 1
        self.batch = batch
        return self.generation

    @staticmethod
    def supports(storage: torch.Tensor) -> bool:
        """Whether the kernel can read this pool (and attend the model's activations): rows
        in the activations' dtype, bf16 ones under fp32 activations, or int8 ones with their
        scales (``kv_format``)."""
        return (
            library() is not None
            and (storage.dtype in DTYPES or storage.dtype == torch.int8)
            and storage.is_contiguous()
        )

    def for_layer(
        self,
        storage: torch.Tensor,
        local: int,
        heads: int,
        head_dim: int,
        scale: float,
        softcap: float | None,
    ) -> tuple[int, int, int, int]:
        """For ``layer.c``, which sets the step's tensors itself: the pool-wide fields set
        (storage as ``__call__``'s), then (args address, segments, the layer's keys and
        values addresses in the pool). The fields are set once for all the pool's layers
        alike (every layer of a step asks: a few microseconds each otherwise)."""
        fields = (heads, head_dim, scale, softcap)
        if storage is not self._layer_storage or fields != self._layer_fields:
            assert self.supports(storage)
            a = self.args
            a.kv_int8, a.kv_bf16 = storage.dtype == torch.int8, storage.dtype == torch.bfloat16
            # storage: [units, layers, 2 (k, v), rows, kv_heads, D]
            a.unit_stride, a.row_stride, a.head_stride = (storage.stride(i) for i in (0, 3, 4))
            a.heads, a.kv_heads, a.head_dim = heads, storage.shape[-2], head_dim
            a.scale, a.softcap = scale, softcap or 0.0
            size = storage.element_size()
            self._layer_strides = (storage.stride(1) * size, storage.stride(2) * size)
            self._layer_storage, self._layer_fields = storage, fields
        layer_bytes, kv_bytes = self._layer_strides
        keys = self._layer_storage.data_ptr() + local * layer_bytes
        return self._address, self.batch, keys, keys + kv_bytes

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        storage: torch.Tensor,
        local: int,
        scale: float,
        softcap: float | None,
    ) -> None:
        """q, out: [N, heads, D] and k, v: [N, kv_heads, D], the step's rows (last dim
        contiguous); storage: [units, layers, 2, rows, kv_heads, D] of a pool it ``supports``
        (int8: D + 4 bytes a row; bf16 under fp32 q), holding every position before each
        segment. Writes the
        segments' rows of ``out``, then stores the kept rows of k, v in the pool."""
        assert all(t.dtype == q.dtype and t.stride(-1) == 1 for t in (q, k, v, out))
        assert storage.dtype in (q.dtype, torch.int8, torch.bfloat16), (storage.dtype, q.dtype)
        a = self.args
        a.fresh_k, a.fk_token_stride, a.fk_head_stride = k.data_ptr(), k.stride(0), k.stride(1)
        a.fresh_v, a.fv_token_stride, a.fv_head_stride = v.data_ptr(), v.stride(0), v.stride(1)
        keys = storage[:, local, 0]
        a.q, a.q_token_stride, a.q_head_stride = q.data_ptr(), q.stride(0), q.stride(1)
        a.out, a.out_token_stride, a.out_head_stride = out.data_ptr(), out.stride(0), out.stride(1)
        a.k, a.v = keys.data_ptr(), storage[:, local, 1].data_ptr()
        a.unit_stride, a.row_stride, a.head_stride = keys.stride(0), keys.stride(1), keys.stride(2)
        a.heads, a.kv_heads, a.head_dim = q.shape[1], storage.shape[-2], q.shape[2]
        a.scale, a.softcap = scale, softcap or 0.0
        a.is_bf16, a.kv_int8 = DTYPES[q.dtype], storage.dtype == torch.int8
        a.kv_bf16 = storage.dtype == torch.bfloat16
        self._layer_storage = None  # the fields above are this call's, not ``for_layer``'s
        num_threads = torch.get_num_threads()
        status = library().baton_paged_attention(ctypes.byref(a), self.batch, num_threads)
        if status != 0:
            raise MemoryError(f"paged attention kernel: no scratch memory (status {status})")
