"""PD with a hybrid model (Qwen3.5 with an MTP draft): the linear layers' recurrent state is
one more declared component (``target.linear``), pushed with the rest -- decode continues
from the state after the last prompt token exactly as a colocated engine does (tokens and
acceptance lengths), and a handoff that skips it is caught by its checksum and changes the
output. In one process over the loopback backend (the other backends move every registered
component alike: ``test_real_backends.py``, ``test_pd_processes.py``).
"""

from __future__ import annotations

import pytest
import torch

from baton.engine.engine import LLMEngine
from baton.sampling_params import SamplingParams
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from tests.engine.test_hybrid import _config, _prompts, run
from tests.hf_tiny import VOCAB
from tests.transfer.inprocess import loopback_pair, run_handoffs

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _pd(directory, skip: frozenset[str] = frozenset(), prompts=None, **kw):
    prefill_engine = LLMEngine(directory, _config(num_speculative_tokens=3, **kw))
    decode_engine = LLMEngine(directory, _config(num_speculative_tokens=3, **kw))
    hello = dict(backend="loopback")
    check_pairing(
        build_hello(decode_engine, directory, worker_id="d", role="decode", **hello),
        build_hello(prefill_engine, directory, worker_id="p", role="prefill", **hello),
    )
    prefill, decode = loopback_pair(prefill_engine, decode_engine, skip)
    outs, arrived = run_handoffs(prefill, decode, prompts or _prompts(), PARAMS)
    return outs, prefill, decode, arrived, (prefill_engine, decode_engine)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "bfloat16"])
def test_pd_of_a_hybrid_model_equals_colocated(hybrid_mtp_checkpoint, kv_cache_dtype):
    """With K/V rows held otherwise too (int8; bf16 under this fp32 model): the attention
    layers' pools hold them so, the recurrent state stays fp32, and the handoff still equals
    colocated."""
    kv = {"kv_cache_dtype": kv_cache_dtype}
    expected = run(hybrid_mtp_checkpoint, _prompts(), PARAMS, num_speculative_tokens=3, **kv)
    outs, prefill, decode, arrived, (p_engine, d_engine) = _pd(hybrid_mtp_checkpoint, **kv)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert d_engine.runner.num_computed_prompt_tokens == 0
    # Every declared component moved bytes -- the recurrent state among them -- and arrived
    # byte-identical.
    assert "target.linear" in decode.bytes_received
    assert set(decode.bytes_received) == set(d_engine.registry.names())
    assert all(n > 0 for n in decode.bytes_received.values())
    for room, sums in arrived.items():
        assert sums == prefill.checksums[room], room
    for engine in (p_engine, d_engine):
        assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()


def test_a_handoff_without_the_recurrent_state_is_caught(hybrid_mtp_checkpoint):
    """The seed's bug class on a hybrid model: the attention pages and the draft's window
    arrive, the recurrent state does not -- its checksum differs and so do the tokens."""
    expected = run(hybrid_mtp_checkpoint, _prompts(), PARAMS, num_speculative_tokens=3)
    outs, prefill, _, arrived, _ = _pd(hybrid_mtp_checkpoint, skip=frozenset({"target.linear"}))
    assert any(
        arrived[r]["target.linear"] != prefill.checksums[r]["target.linear"] for r in arrived
    )
    assert all(arrived[r]["target.full"] == prefill.checksums[r]["target.full"] for r in arrived)
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in expected]


def test_the_handshake_names_a_missing_recurrent_component(hybrid_mtp_checkpoint):
    directory = hybrid_mtp_checkpoint
    prefill_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    decode_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    prefill_engine.registry._components.pop("target.linear")
    hello = dict(backend="loopback")
    with pytest.raises(PairingError, match="target.linear"):
        check_pairing(
            build_hello(
                decode_engine, hybrid_mtp_checkpoint, worker_id="d", role="decode", **hello
            ),
            build_hello(
                prefill_engine, hybrid_mtp_checkpoint, worker_id="p", role="prefill", **hello
            ),
        )


def test_prefill_and_decode_prefix_hits_keep_pd_exact(hybrid_mtp_checkpoint):
    """Both workers cache: the second prompt hits 64 tokens on prefill (its recurrent
    snapshot restored there, the rest computed) and on decode (which needs no snapshot: the
    handoff brings the state after the last prompt token). Tokens and acceptance lengths
    equal cold colocated runs; every checksum matches."""
    directory = hybrid_mtp_checkpoint
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    expected = [run(directory, [p], PARAMS, num_speculative_tokens=3)[0] for p in prompts]
    prefill_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    decode_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    prefill, decode = loopback_pair(prefill_engine, decode_engine)
    outs, computed = [], []
    for prompt in prompts:  # one after the other: the second one hits on both sides
        before = prefill_engine.runner.num_computed_prompt_tokens
        done, arrived = run_handoffs(prefill, decode, [prompt], PARAMS)
        outs += done
        assert arrived[0] == prefill.checksums[0]
        computed.append(prefill_engine.runner.num_computed_prompt_tokens - before)
    assert computed == [len(prompts[0]), len(prompts[1]) - 64]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert decode_engine.runner.num_computed_prompt_tokens == 0
    for engine in (prefill_engine, decode_engine):
        assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()
