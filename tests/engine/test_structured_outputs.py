"""Structured outputs on the engine: every output follows its grammar, in every sampling mode,
with speculation on and off; greedy speculation equals greedy decoding; sampled verification
keeps the masked distribution. The oracle of "follows its schema" is ``jsonschema``; of a
prefix (an output cut by ``max_tokens``), a fresh matcher accepting its tokens.

The bundled model (``baton-stdlib-qwen3``: a tokenizer, an MTP draft) is not trained for JSON:
only the grammar makes these outputs valid, which is the point.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.sampling.grammar import GrammarCompiler, apply_masks, compute_masks
from baton.sampling.sampler import Sampler
from baton.sampling.sampling_state import SamplingState
from baton.sampling_params import InvalidRequest, SamplingParams, StructuredOutputsParams
from baton.speculative.verify import verify_chain

MODEL = "baton-stdlib-qwen3"
PROMPTS = ["def parse(data):", "The record is ", "import json\n", "x"]


@pytest.fixture(scope="module")
def engines():
    """An engine with its MTP draft, one speculating with n-grams, one without, fp32."""
    found = {
        spec: LLMEngine(MODEL, EngineConfig.from_kwargs(dtype="float32", speculative=spec))
        for spec in (None, False)
    }
    config = EngineConfig.from_kwargs(dtype="float32", speculative_method="ngram")
    return {**found, "ngram": LLMEngine(MODEL, config)}


def _run(engine: LLMEngine, prompts, params) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.tracks
    return [done[i] for i in ids]


def _follows(engine: LLMEngine, output, spec: StructuredOutputsParams, schema=None) -> None:
    """A finished output parses and validates; one cut by its length is a prefix the grammar
    accepts token by token."""
    completion = output.outputs[0]
    if completion.finish_reason == "stop" and schema is not None:
        jsonschema.validate(json.loads(completion.text), schema)
    matcher = engine.grammars.matcher(spec)
    tokens = [t for t in completion.token_ids if t not in engine.eos_token_ids]
    assert all(matcher.accept(t) for t in tokens), (completion.text, matcher.error)
    if completion.finish_reason == "stop":
        assert matcher.is_terminated or matcher._matcher.is_accepting(), completion.text


# -- random schemas: objects, arrays, enums, bounded numbers, nesting, optional fields ---------
_names = st.text("abcdefghij_", min_size=1, max_size=6)
_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.builds(
        lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
        st.integers(-5, 5),
        st.integers(1, 10),
    ),
    st.just({"type": "boolean"}),
    st.lists(
        st.sampled_from(["red", "green", "x", "42", "null"]), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
)


def _object(children):
    def build(fields, required_mask):
        names = list(fields)
        required = [n for n, keep in zip(names, required_mask, strict=False) if keep]
        return {
            "type": "object",
            "properties": fields,
            "required": required,
            "additionalProperties": False,
        }

    return st.builds(
        build,
        st.dictionaries(_names, children, min_size=1, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3),
    )


_schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(
            lambda item, n: {"type": "array", "items": item, "maxItems": n},
            children,
            st.integers(0, 3),
        ),
    ),
    max_leaves=6,
).filter(lambda s: s.get("type") in ("object", "array"))

_sampling = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.3]),
        "top_k": st.sampled_from([0, 1, 5, 50]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5]),
        "min_p": st.sampled_from([0.0, 0.05]),
        "repetition_penalty": st.sampled_from([1.0, 1.2]),
        "frequency_penalty": st.sampled_from([0.0, 0.5]),
        "presence_penalty": st.sampled_from([0.0, -0.5]),
        "seed": st.integers(0, 2**31),
    }
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=_schemas, sampling=_sampling, speculative=st.sampled_from([None, False]))
def test_every_output_follows_its_random_schema(engines, schema, sampling, speculative):
    engine = engines[speculative]
    spec = StructuredOutputsParams(json=schema)
    params = SamplingParams(max_tokens=160, structured_outputs=spec, **sampling)
    for output in _run(engine, PROMPTS[:3], params):
        _follows(engine, output, spec, schema)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutputsParams(choice=["yes", "no", "it depends"]),
        StructuredOutputsParams(grammar='start: "f(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
    ],
    ids=["json", "json_object", "regex", "choice", "lark"],
)
@pytest.mark.parametrize("method", [None, "ngram"], ids=["mtp", "ngram"])
def test_greedy_speculation_equals_greedy_decoding_under_a_grammar(engines, spec, method):
    """With the MTP draft every request verifies chains; with n-grams, those whose text
    repeats (a chain, repaired to the grammar, is verified like the draft's)."""
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=spec)
    with_draft = _run(engines[method], PROMPTS, params)
    plain = _run(engines[False], PROMPTS, params)
    assert [o.outputs[0].token_ids for o in with_draft] == [o.outputs[0].token_ids for o in plain]
    for output in with_draft:
        _follows(engines[method], output, spec)
        if method is None:
            assert output.metrics.accepted_lengths, "no speculative step ran"
    if spec.regex or spec.choice:  # short languages: every output is complete
        assert all(o.outputs[0].finish_reason == "stop" for o in with_draft)
    if method == "ngram" and not (spec.regex or spec.choice):  # long outputs repeat
        assert any(o.metrics.accepted_lengths for o in with_draft), "no n-gram chain ran"


def test_the_per_step_draft_path_masks_its_guesses_and_matches_too(engines):
    """Without the native chain, the proposer masks each guess (``_chain``): the same
    greedy output; and its guesses are only tokens the grammar allows."""
    engine = LLMEngine(MODEL, EngineConfig.from_kwargs(dtype="float32"))
    engine.proposer.chain = None  # the reference: one draft step, one mask, per guess
    spec = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
    proposed: list[tuple[str, list[bool]]] = []
    chain = engine.proposer._chain

    def recording(request_ids, slots, hiddens, grammars):
        chains = chain(request_ids, slots, hiddens, grammars)
        for rid, matcher in grammars.items():  # back where the guesses start
            with matcher.tentative():
                allowed = [matcher.allows(t) and matcher.accept(t) for t in chains[rid]]
            proposed.append((rid, allowed))
        return chains

    engine.proposer._chain = recording
    per_step = _run(engine, PROMPTS, params)
    plain = _run(engines[False], PROMPTS, params)
    assert [o.outputs[0].token_ids for o in per_step] == [o.outputs[0].token_ids for o in plain]
    assert proposed and all(all(allowed) for _, allowed in proposed), proposed
    assert all(o.metrics.accepted_lengths for o in per_step)


def test_a_grammar_forces_what_the_model_would_not_write(engines):
    engine = engines[None]
    free = _run(engine, ["x"], SamplingParams(temperature=0.0, max_tokens=12))[0]
    spec = StructuredOutputsParams(choice=["TRUE", "FALSE"])
    forced = _run(
        engine, ["x"], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec)
    )[0]
    assert free.outputs[0].text not in ("TRUE", "FALSE")
    assert forced.outputs[0].text in ("TRUE", "FALSE")
    assert forced.outputs[0].finish_reason == "stop"


def test_min_tokens_does_not_lengthen_a_complete_grammar(engines):
    spec = StructuredOutputsParams(choice=["ok"])
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=8, min_tokens=6, structured_outputs=spec
    )
    (output,) = _run(engines[None], ["x"], params)
    assert output.outputs[0].text == "ok"
    assert output.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("structured", "named"),
    [
        ({"json": {"type": "object", "if": {"type": "object"}}}, 'Unimplemented keys: ["if"]'),
        ({"json": {"type": "string", "format": "ipv9"}}, "Unknown format: ipv9"),
        ({"regex": "[a-"}, "unclosed character class"),
        ({"grammar": "start: nothing_here"}, 'unknown name: "nothing_here"'),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ],
)
def test_an_unsupported_grammar_is_refused_by_name_and_keeps_nothing(engines, structured, named):
    engine = engines[None]
    with pytest.raises(InvalidRequest, match=named.replace("[", r"\[").replace("(", r"\(")) as err:
        engine.add_request("x", SamplingParams(structured_outputs=structured))
    assert err.value.param.startswith("structured_outputs.")
    assert not engine.tracks and not engine.has_unfinished_requests()


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(InvalidRequest, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequest, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequest, match="unknown fields"):
        SamplingParams(structured_outputs={"jsonschema": {}})
    with pytest.raises(InvalidRequest, match="choice"):
        StructuredOutputsParams(choice=[])
    same = StructuredOutputsParams(json='{"type": "object"}').key()
    assert same == StructuredOutputsParams(json={"type": "object"}).key()


# -- sampled verification keeps the masked distribution ------------------------------------------
def _chi2_quantile_999(dof: int) -> float:
    """Wilson-Hilferty: the 0.999 quantile of chi-square with ``dof`` degrees of freedom."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_verification_under_a_grammar_keeps_the_masked_distribution(engines):
    compiler: GrammarCompiler = engines[None].grammars
    spec = StructuredOutputsParams(regex=r"[0-4][0-4]")
    vocab = compiler.vocab_size
    first_mask = compute_masks([compiler.matcher(spec)], vocab)
    allowed = apply_masks(torch.zeros(1, vocab), [0], first_mask)[0].isfinite().nonzero()[:, 0]
    assert 3 <= len(allowed) <= 40, allowed
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)  # k = 2 proposals + bonus
    logits[:, allowed] += 3.0  # the allowed tokens carry most of the mass before masking
    params = SamplingParams(temperature=1.0, max_tokens=4, structured_outputs=spec)
    masked0 = apply_masks(logits[:1], [0], first_mask)[0].softmax(-1)
    # A middling one-character guess: rejected often enough, and the second position open.
    single = [int(t) for t in allowed if len(compiler.tokenizer.decode_str([int(t)])) == 1]
    single.sort(key=lambda t: float(masked0[t]))
    draft = single[len(single) // 2]
    after = compiler.matcher(spec)
    assert after.accept(draft)
    second_mask = compute_masks([after], vocab)
    masked1 = apply_masks(logits[1:2], [0], second_mask)[0].softmax(-1)
    second_draft = int(masked1.argmax())
    counts0, counts1 = torch.zeros(vocab), torch.zeros(vocab)
    sampler = Sampler(frozenset({0, 2}))
    for seed in range(2500):
        state = SamplingState(params, [5], vocab, seed=seed, grammar=compiler.matcher(spec))
        tokens = verify_chain(sampler, logits, [draft, second_draft], state)
        counts0[tokens[0]] += 1
        if tokens[0] == draft:
            counts1[tokens[1]] += 1
        # The matcher kept exactly these (EOS ends a complete grammar, it is not consumed).
        assert state.grammar.num_tokens == len([t for t in tokens if t not in (0, 2)])
    for counts, probs in ((counts0, masked0), (counts1, masked1)):
        support = probs > 0
        assert counts[~support].sum() == 0, "a token the grammar forbids was committed"
        big = support & (probs * counts.sum() >= 5)
        expected = probs[big] * counts[big].sum() / probs[big].sum()
        chi2 = float(((counts[big] - expected) ** 2 / expected).sum())
        assert int(big.sum()) >= 3, "too few tokens to test"
        assert chi2 < _chi2_quantile_999(int(big.sum()) - 1), chi2


def test_a_native_chain_is_repaired_to_tokens_the_grammar_allows(engines):
    compiler = engines[None].grammars
    matcher = compiler.matcher(StructuredOutputsParams(json={"type": "array"}))
    tokenizer = compiler.tokenizer
    start = tokenizer.tokenize_str("[1, ")
    assert all(matcher.accept(t) for t in start)
    forbidden = tokenizer.tokenize_str("def f")[0]
    allowed_first = tokenizer.tokenize_str("2")[0]
    for guesses in ([forbidden] * 4, [allowed_first, forbidden, forbidden, forbidden]):
        chain = matcher.repair(guesses)
        assert len(chain) == len(guesses) and forbidden not in chain
        assert matcher.num_tokens == len(start)  # left as it came
        with matcher.tentative():
            assert all(matcher.allows(t) and matcher.accept(t) for t in chain), chain
    assert matcher.repair([allowed_first])[0] == allowed_first  # an allowed guess is kept


def test_llm_chat_renders_the_template_and_takes_a_grammar():
    from baton import LLM

    llm = LLM(MODEL, dtype="float32")
    conversations = [
        [{"role": "user", "content": "Give me a record."}],
        [{"role": "system", "content": "JSON only."}, {"role": "user", "content": "Another."}],
    ]
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1, 2]}}})
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
    chats = llm.chat(conversations, params)
    prompts = [
        llm.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations
    ]
    assert [o.outputs[0].text for o in chats] == [
        o.outputs[0].text for o in llm.generate(prompts, params)
    ]
    assert all(o.outputs[0].text.startswith("{") for o in chats)
    (one,) = llm.chat(conversations[0], params)  # one conversation: one output
    assert one.outputs[0].text == chats[0].outputs[0].text
