"""Python side of ``paged_attention.c``: one call attends a batch of short segments.

``PagedAttentionCall`` is built once per pool and forward from the batch plan's index lists
(int32 tensors it keeps alive) and run once per layer with that layer's q, output and pool
storage. Who calls it: ``baton.model.paged_attention``, whose torch path is the reference.
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
    ]


_LIST_FIELDS = ("units", "num_units", "key_base", "q_offset", "q_start", "q_count", "first",
                "store_token", "store_unit", "store_row")  # fmt: skip
"""The ``Args`` pointers into the call's one buffer, in the order the lists are in it."""


class PagedAttentionCall:
    """The segments' index lists, ready for the kernel.

    unit_lists: per segment the units holding its context in order; key_base: per segment
    the position held by row 0 of its first unit (pages; ignored when ``is_ring``); q_offset,
    q_start, num_queries, first: per segment the step token of its first query (its queries
    are consecutive), that query's position, its queries, its lowest visible position;
    store_token, store_unit, store_row: where each kept row of the step's K/V goes.
    """

    def __init__(
        self,
        unit_lists: list[list[int]],
        key_base: list[int],
        q_offset: list[int],
        q_start: list[int],
        num_queries: list[int],
        first: list[int],
        store_token: list[int],
        store_unit: list[int],
        store_row: list[int],
        rows: int,
        window: int | None,
        is_ring: bool,
    ) -> None:
        max_units = max(map(len, unit_lists))
        num_units = [len(u) for u in unit_lists]
        # One int32 buffer holds every list, built in one go (NOTE: array's C loop, not
        # torch.tensor's per-element conversion: a tenth of the time); the struct points
        # into it. Units first: [B, max_units] row-major, padded with unit 0.
        values: list[int] = []
        for units in unit_lists:
            values += units
            values += [0] * (max_units - len(units))
        lists = (num_units, key_base, q_offset, q_start, num_queries, first, store_token,
                 store_unit, store_row)  # fmt: skip
        starts = [0]
        for values_of in lists:
            starts.append(len(values))
            values += values_of
        self._keep = keep = array.array("i", values)  # never resized: the pointers stay valid
        base = keep.buffer_info()[0]
        args = _Args()
        for name, at in zip(_LIST_FIELDS, starts, strict=True):
            setattr(args, name, base + 4 * at)
        self.batch = len(num_units)
        args.max_units, args.rows, args.num_stores = max_units, rows, len(store_token)
        args.window, args.is_ring = window or 0, int(is_ring)
        self.args = args
        self._address = ctypes.addressof(args)
        self._layer_storage: torch.Tensor | None = None  # ``for_layer``'s last pool
        self._layer_fields: tuple = ()
        self._layer_strides = (0, 0)

    @staticmethod
    def supports(storage: torch.Tensor) -> bool:
        """Whether the kernel can read this pool (and attend the model's activations)."""
        return library() is not None and storage.dtype in DTYPES and storage.is_contiguous()

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
            assert storage.dtype in DTYPES and storage.is_contiguous()
            a = self.args
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
        contiguous); storage: [units, layers, 2, rows, kv_heads, D] of a pool it ``supports``,
        holding every position before each segment. Writes the segments' rows of ``out``, then
        stores the kept rows of k, v in the pool."""
        assert all(t.dtype == storage.dtype and t.stride(-1) == 1 for t in (q, k, v, out))
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
        a.is_bf16 = DTYPES[q.dtype]
        self._layer_storage = None  # the fields above are this call's, not ``for_layer``'s
        num_threads = torch.get_num_threads()
        status = library().baton_paged_attention(ctypes.byref(a), self.batch, num_threads)
        if status != 0:
            raise MemoryError(f"paged attention kernel: no scratch memory (status {status})")
