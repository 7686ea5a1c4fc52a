"""The one-pass norm kernels (baton/kernels/norm.c) against the torch code they replace,
and bitwise against transformers' RMSNorm formula (``x.pow(2).mean(-1)``, ``rsqrt``).

The kernels round to bf16 where torch does and add the sum of squares in the order of
torch's sum kernel, so they equal transformers' formula bit for bit; the engine's torch path
(``F.rms_norm``) adds in another order: within one bf16 step, on a small fraction of
elements.
"""

from __future__ import annotations

import pytest
import torch

import baton.kernels.norm as norm
from baton.kernels import library
from baton.model.layers import RMSNorm, apply_rotary

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
pytestmark = [
    pytest.mark.skipif(library() is None, reason=OFF),
    pytest.mark.usefixtures("kernel_level"),  # every instruction-set level this CPU runs
]


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


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """transformers' Llama/Qwen3 RMSNorm (offset 0) and Gemma's (offset 1), as written there."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).type_as(x)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dim", [8, 64, 100, 256, 1000, 4096])
def test_rms_norm_equals_transformers_bitwise(dtype, offset, dim):
    """Every dim path of the ordered sum: a leftover element tail (100, 1000), leftover
    vectors, and the cascade's upper levels (4096: 128+ vectors of 8)."""
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(300, dim, generator=g) * 3).to(dtype)
    weight = (torch.randn(dim, generator=g) * 0.5 + (0 if offset else 1)).to(dtype)
    got = norm.rms_norm(x, weight, 1e-6, offset)
    assert torch.equal(got, _hf_rms_norm(x, weight, 1e-6, offset))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rotary_equals_transformers_bitwise(dtype):
    """Qwen3's q/k norm then ``apply_rotary_pos_emb`` (rotate_half), as transformers runs them."""
    g = torch.Generator().manual_seed(3)
    b, t, n, d = 2, 9, 6, 64
    heads = (torch.randn(b, t, n, d, generator=g) * 2).to(dtype)
    weight = (torch.randn(n, d, generator=g) * 0.3 + 1).to(dtype)
    angles = torch.arange(t)[None, :, None, None] * torch.rand(d // 2, generator=g)
    emb = torch.cat((angles, angles), dim=-1).expand(b, -1, -1, -1).contiguous()
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = norm.rms_norm_rotary(heads, weight, 1e-6, cos, sin)
    normed = _hf_rms_norm(heads, weight, 1e-6, 0.0)
    assert torch.equal(got, apply_rotary(normed, cos, sin))


def test_sum_order_is_found_for_this_torch():
    assert norm.torch_lanes() in (8, 16)
    values = torch.randn(256, generator=torch.Generator().manual_seed(1)).pow(2)
    assert norm._sum_in_order(values.tolist(), norm.torch_lanes()) == values.sum().item()


def test_kernels_step_aside_for_autograd():
    module = RMSNorm(16, 1e-6)
    x = torch.randn(2, 16, requires_grad=True)
    assert norm.rms_norm(x, module.weight, 1e-6, 0.0) is None
    module(x).sum().backward()  # the torch path: gradients flow
    assert x.grad is not None
