"""The bundled model: loadable by transformers and baton alike, parity, and its draft.

These tests use the committed weights in ``models/baton-stdlib-qwen3``.
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.corpus import held_out_texts
from baton.model import load_draft, load_model
from tests.conftest import BUNDLED

pytestmark = pytest.mark.skipif(
    not (BUNDLED / "model.safetensors").is_file(), reason="bundled weights not trained yet"
)


@pytest.fixture(scope="module")
def held_out_prompts():
    from baton.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED)
    prompts = []
    for text in held_out_texts()[:8]:
        ids = tok.encode(text)
        prompts.append(ids[:200])
    return prompts


def test_transformers_loads_it_and_agrees(held_out_prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(BUNDLED)
    assert tok("import os").input_ids == LLM_tokenizer().encode("import os")
    ours = load_model(BUNDLED, "float32")
    ids = torch.tensor([held_out_prompts[0][:160]])
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(160)[None], _dense()))
    assert (got - expected).abs().max().item() < 1e-4
    with torch.no_grad():
        hf_ids = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    from baton.model.reference import greedy_generate

    assert greedy_generate(ours, ids[0].tolist(), 32) == hf_ids[0, 160:].tolist()


def LLM_tokenizer():  # noqa: N802
    from baton.tokenizer import Tokenizer

    return Tokenizer.from_dir(BUNDLED)


def _dense():
    from baton.model import DenseAttention

    return DenseAttention()


def test_engine_greedy_matches_transformers_on_mixed_lengths(held_out_prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    lengths = [5, 16, 64, 128, 129, 200]  # page 16, window 128, draft window 64
    prompts = [p[:n] for p, n in zip(held_out_prompts, lengths, strict=False)]
    llm = LLM(BUNDLED, dtype="float32", speculative=False, max_num_batched_tokens=96)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("mode", ["paged", "ring"])
def test_speculation_is_exact_and_accepts_at_least_two(held_out_prompts, mode):
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": p[:n]}
        for p, n in zip(held_out_prompts, [7, 64, 130, 200], strict=False)
    ]  # noqa: E501
    plain = LLM(BUNDLED, dtype="float32", speculative=False, sliding_mode=mode)
    spec = LLM(BUNDLED, dtype="float32", sliding_mode=mode)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    steps = [a for o in outs for a in o.metrics.accepted_lengths]
    assert sum(steps) / len(steps) >= 2.0


def test_missing_draft_prompt_state_shows_in_early_acceptance(held_out_prompts):
    """The signature of a draft state that never arrived: lower acceptance over the first
    draft window of decode, recovery after it. The metric must see it."""
    params = SamplingParams(temperature=0, max_tokens=192, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in held_out_prompts]
    window = load_draft(BUNDLED, load_model(BUNDLED)).draft_spec.sliding_window

    def split(llm) -> tuple[float, float]:
        early, late = [], []
        for out in llm.generate(prompts, params):
            generated = 0
            for a in out.metrics.accepted_lengths:
                (early if generated < window else late).append(a)
                generated += a
        return sum(early) / len(early), sum(late) / len(late)

    full_early, full_late = split(LLM(BUNDLED, dtype="float32"))
    empty_early, empty_late = split(
        LLM(BUNDLED, dtype="float32", debug_empty_draft_prompt_state=True)
    )
    assert empty_early < full_early - 0.1
    assert abs(empty_late - full_late) < 0.15


def test_pd_without_draft_state_shows_the_early_acceptance_drop(held_out_prompts):
    """PD on the bundled model: with every component pushed, acceptance equals colocated; a
    prefill that skips `draft.swa` (registry intact, so the handshake passes) leaves the
    decode's draft with an empty window: same text, lower acceptance early on."""
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.transfer.backends.loopback import LoopbackBackend
    from baton.transfer.sender import Sender
    from tests.transfer.inprocess import InProcessDecode

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    config = EngineConfig.from_kwargs(dtype="float32")
    prompts = held_out_prompts[:6]

    def run(skip: frozenset[str]) -> tuple[list[list[int]], float]:
        decode_engine = LLMEngine(BUNDLED, config)
        receiver = LoopbackBackend()
        regions = {
            c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
        }
        prefill = Sender(LLMEngine(BUNDLED, config), LoopbackBackend())
        prefill.debug_skip_components = skip
        prefill.connect(regions)
        decode = InProcessDecode(decode_engine)
        for room, prompt in enumerate(prompts):
            assert prefill.on_reserve(decode.reserve(room, prompt, params)) is None
        done = {}
        while prefill.outgoing or decode_engine.has_unfinished_requests():
            for reply in prefill.step():
                decode.on_done(reply)
            done.update({o.request_id: o for o in decode_engine.step() if o.finished})
        outs = [done[f"room-{r}"] for r in range(len(prompts))]
        early = [a for o in outs for a in o.metrics.accepted_lengths[:8]]
        return [o.outputs[0].token_ids for o in outs], sum(early) / len(early)

    colocated = LLM(BUNDLED, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params
    )
    expected = [o.outputs[0].token_ids for o in colocated]
    expected_early = [a for o in colocated for a in o.metrics.accepted_lengths[:8]]
    tokens, early = run(frozenset())
    assert tokens == expected
    assert early == pytest.approx(sum(expected_early) / len(expected_early))
    tokens_skip, early_skip = run(frozenset({"draft.swa"}))
    assert tokens_skip == expected  # verification keeps the text right...
    assert early_skip < early - 0.2  # ...but the missing draft state costs acceptance


def test_a_prefix_hit_without_the_draft_state_shows_in_early_acceptance(held_out_prompts):
    """A repeated prompt hits the prefix cache: same text and the same acceptance as a cold
    run. Restoring the target's pages but not the draft's (a debug switch: the bug of a cache
    path that forgets the draft) keeps the text and costs early acceptance -- the metric
    catches it."""
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine

    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = [p[:200] for p in held_out_prompts[:6]]

    def run(**options) -> tuple[list[list[int]], list[list[int]], int]:
        engine = LLMEngine(BUNDLED, EngineConfig.from_kwargs(dtype="float32", **options))
        outs = []
        for _ in range(2):  # the second pass hits what the first one cached
            outs = []
            for prompt in prompts:
                rid = engine.add_request({"prompt_token_ids": prompt}, params)
                while engine.has_unfinished_requests():
                    outs += [o for o in engine.step() if o.finished and o.request_id == rid]
        cached = sum(o.metrics.num_cached_tokens for o in outs)
        return (
            [o.outputs[0].token_ids for o in outs],
            [o.metrics.accepted_lengths for o in outs],
            cached,
        )

    def early(accepted: list[list[int]]) -> float:
        firsts = [a for lengths in accepted for a in lengths[:6]]
        return sum(firsts) / len(firsts)

    cold = LLM(BUNDLED, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params
    )
    tokens, accepted, cached = run()
    assert cached == 6 * 192  # every prompt: all complete pages but the one of its last token
    assert tokens == [o.outputs[0].token_ids for o in cold]
    assert accepted == [o.metrics.accepted_lengths for o in cold]
    tokens_skip, accepted_skip, _ = run(debug_prefix_cache_skip_draft=True)
    assert tokens_skip == tokens
    assert early(accepted_skip) < early(accepted) - 0.2


def test_the_bundled_model_is_found_by_name_from_any_directory(tmp_path):
    """Issue 39: ``LLM("models/baton-stdlib-qwen3")`` worked only from the repository root."""
    import subprocess
    import sys

    from baton.config import BUNDLED_MODEL_DIR, resolve_model_dir

    assert resolve_model_dir("baton-stdlib-qwen3") == BUNDLED_MODEL_DIR
    assert resolve_model_dir(tmp_path) == tmp_path  # a path is taken as given
    (tmp_path / "baton-stdlib-qwen3").mkdir()  # a directory of that name here wins
    code = (
        "import os; from baton.config import resolve_model_dir; "
        "print(resolve_model_dir('baton-stdlib-qwen3'))"
    )
    here = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here == "baton-stdlib-qwen3"
    elsewhere = subprocess.run(
        [
            sys.executable,
            "-m",
            "baton",
            "generate",
            "--model",
            "baton-stdlib-qwen3",
            "--max-tokens",
            "4",
            "def f(x):",
        ],
        cwd=tmp_path / "baton-stdlib-qwen3",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert elsewhere.returncode == 0, elsewhere.stderr
