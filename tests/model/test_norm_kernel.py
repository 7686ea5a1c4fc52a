"""The one-pass norm kernels (baton/kernels/norm.c) against the torch code they replace.

The kernels round to bf16 where torch does, so outputs agree except where the sum of
squares, added in another order, moves a value across a rounding boundary: at most one bf16
step, on a small fraction of elements.
"""

from __future__ import annotations

import pytest
import torch

import baton.kernels.norm as norm
from baton.kernels import library
from baton.model.layers import RMSNorm, apply_rotary

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
pytestmark = pytest.mark.skipif(library() is None, reason=OFF)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    step = want.float().abs().clamp_min(1e-3) * 2**-7  # one bf16 step (8 significant bits)
    off = (got.float() - want.float()).abs()
    assert bool((off <= step * 1.01).all()), f"off by {off.max().item()}"
    assert (off > 0).float().mean().item() < 0.01  # nearly all bitwise equal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_torch(dtype, offset, monkeypatch):
    torch.manual_seed(0)
    module = RMSNorm(256, 1e-6, offset).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(256) * 0.5 + (0 if offset else 1))
    x = (torch.randn(3, 37, 256) * 3).to(dtype)
    with torch.inference_mode():
        got = module(x)
        monkeypatch.setattr(norm, "library", lambda: None)
        want = module(x)
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rotary_matches_torch(dtype, monkeypatch):
    torch.manual_seed(1)
    heads, kv_heads, d, tokens = 4, 2, 64, 19
    qkv = torch.randn(2, tokens, (heads + 2 * kv_heads) * d).to(dtype)
    qk = qkv[..., : (heads + kv_heads) * d].unflatten(-1, (heads + kv_heads, d))  # a view
    weight = (torch.randn(heads + kv_heads, d) * 0.3 + 1).to(dtype)
    angles = torch.arange(tokens)[None, :, None, None] * torch.rand(d // 2) * 0.3
    emb = torch.cat((angles, angles), dim=-1).expand(2, -1, -1, -1).contiguous()
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = norm.rms_norm_rotary(qk, weight, 1e-6, cos, sin)
    normed = weight * torch.nn.functional.rms_norm(qk.float(), (d,), eps=1e-6).to(dtype)
    want = apply_rotary(normed, cos, sin)  # the torch path of Attention._fused_qkv
    assert got is not None and got.shape == want.shape
    _close(got, want)


def test_kernels_step_aside_for_autograd():
    module = RMSNorm(16, 1e-6)
    x = torch.randn(2, 16, requires_grad=True)
    assert norm.rms_norm(x, module.weight, 1e-6, 0.0) is None
    module(x).sum().backward()  # the torch path: gradients flow
    assert x.grad is not None
