"""``layer.c``'s argument structs as ctypes ``Structure``s, field for field: the one place
their layout is mirrored on the Python side (``layer.py`` fills them; ``chain.py`` reaches
them through ``NativeLayer``).
"""

from __future__ import annotations

import ctypes

_ptr, _i32, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class LayerArgs(ctypes.Structure):
    # Field for field the ``Layer`` struct of layer.c.
    _fields_ = [
        *(
            (name, _ptr)
            for name in (
                "input_norm",
                "post_norm",
                "qkv",
                "qkv_bias",
                "qk_norm",
                "o",
                "o_bias",
                "gate",
                "gate_bias",
                "up",
                "up_bias",
                "down",
                "down_bias",
            )
        ),
        *(
            (name, _i32)
            for name in (
                "hidden",
                "intermediate",
                "heads",
                "kv_heads",
                "head_dim",
                "act",
            )
        ),
        ("eps", _f32),
        ("norm_offset", _f32),
        ("qk_eps", _f32),
        ("w_format", _i32),
        ("round_once", _i32),
    ]


class StepArgs(ctypes.Structure):
    # Field for field the ``Step`` struct of layer.c.
    _fields_ = [
        ("x", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("k_pool", _ptr),
        ("v_pool", _ptr),
        ("attn", _ptr),
        *(
            (name, _i32)
            for name in (
                "tokens",
                "batch",
                "act_bf16",
                "lanes",
                "num_threads",
            )
        ),
    ]


class StackLayerArgs(ctypes.Structure):
    # Field for field the ``StackLayer`` struct of layer.c.
    _fields_ = [
        ("layer", _ptr),
        ("attn", _ptr),
        ("k_pool", _ptr),
        ("v_pool", _ptr),
        ("batch", _i32),
    ]


class StackPlanArgs(ctypes.Structure):
    # Field for field the ``StackPlan`` struct of layer.c.
    _fields_ = [
        *((name, _ptr) for name in ("args", "tables", "table_lens", "buffer")),
        ("capacity", ctypes.c_int64),
        ("keep", _i32),
        ("covers_own", _i32),
    ]


class StackArgs(ctypes.Structure):
    # Field for field the ``Stack`` struct of layer.c.
    _fields_ = [
        *(
            (name, _ptr)
            for name in (
                "ids",
                "embed",
                "norm",
                "out",
                "cos",
                "sin",
                "positions",
                "layers",
            )
        ),
        ("eps", _f32),
        ("offset", _f32),
        *(
            (name, _i32)
            for name in (
                "num_layers",
                "tokens",
                "hidden",
                "act_bf16",
                "lanes",
                "num_threads",
                "table_rows",
            )
        ),
        *((name, _ptr) for name in ("head", "head_bias", "best", "logprob")),
        *((name, _i32) for name in ("vocab", "head_op", "head_w_format")),
        ("plans", _ptr),
        ("segs", _ptr),
        *((name, _i32) for name in ("num_plans", "batch", "failed_plan")),
    ]
