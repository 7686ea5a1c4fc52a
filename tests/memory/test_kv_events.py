"""KV events (issue 42): the prefix cache's pages cached and evicted, as events a router
replays into a model of the cache -- which must equal the real cache after every step of
random request streams with shared prefixes, aborts, preemption and evictions; and the same
events over ZMQ in vLLM's KV-event wire format, read with a plain msgpack decoder."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from baton.memory.prefix_cache import CacheEvent
from baton.memory.state import Caching
from baton.sampling_params import SamplingParams
from baton.server.kv_events import KVEventPublisher, block_hash
from tests.memory.test_prefix_cache import (  # noqa: F401
    PAGE,
    REQUEST_STREAMS,
    _engine,
    _tokens,
    add_stream,
    spec_dir,
)


class CacheModel:
    """What a router knows of a worker's cache: per component, the keys stored and not
    removed since, each with its parent and tokens."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[bytes, CacheEvent]] = {}

    def apply(self, events: list[CacheEvent]) -> None:
        for e in events:
            blocks = self.blocks.setdefault(e.component, {})
            if e.stored:
                assert e.key not in blocks, f"{e.component}: stored twice without a removal"
                assert len(e.token_ids) == PAGE, e
                blocks[e.key] = e
            else:
                assert e.key in blocks, f"{e.component}: removed a block never stored"
                del blocks[e.key]


def _paged(engine):
    return [c for c in engine.registry if c.caching is Caching.PAGES]


def _check(engine, model: CacheModel) -> None:
    model.apply(engine.prefix_cache.drain_events())
    for c in _paged(engine):
        assert set(model.blocks.get(c.name, {})) == set(c.owner.cached), c.name


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(REQUEST_STREAMS)
def test_replayed_events_equal_the_cache_after_every_step(spec_dir, stream):  # noqa: F811
    engine = _engine(spec_dir, num_pages=14, max_num_seqs=3, max_num_batched_tokens=16)
    engine.prefix_cache.enable_events()
    model = CacheModel()
    aborted = add_stream(engine, stream)[2]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 2:
            for rid in aborted:
                engine.abort_request(rid)
        _check(engine, model)


def test_evictions_become_removals_and_blocks_chain_to_their_parents(spec_dir):  # noqa: F811
    engine = _engine(spec_dir, num_pages=12, max_num_seqs=2)
    engine.prefix_cache.enable_events()
    model, seen = CacheModel(), []
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [_tokens(40, 50 + seed) for seed in range(6)]  # far more pages than the pool
    for prompt in prompts:
        rid = engine.add_request({"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
            events = engine.prefix_cache.drain_events()
            seen += events
            model.apply(events)
        del rid
    assert any(not e.stored for e in seen)  # evictions happened and were told
    for c in _paged(engine):
        assert set(model.blocks.get(c.name, {})) == set(c.owner.cached), c.name
    # The target's full pages of a prompt: page 0 has no parent, page p the key of p - 1,
    # and carries the prompt's tokens of that page (the draft's are shifted by one).
    full = [e for e in seen if e.stored and e.component == "target.full"]
    by_key = {e.key: e for e in full}
    first = next(e for e in full if e.token_ids == tuple(prompts[0][:PAGE]))
    assert first.parent is None
    second = next(e for e in full if e.parent == first.key)
    assert second.token_ids == tuple(prompts[0][PAGE : 2 * PAGE])
    assert all(e.parent is None or e.parent in by_key for e in full)
    draft = [e for e in seen if e.stored and e.component.startswith("draft")]
    assert any(e.token_ids == tuple(prompts[0][1 : PAGE + 1]) for e in draft)


def test_the_publisher_sends_vllm_shaped_batches_over_zmq(spec_dir):  # noqa: F811
    engine = _engine(spec_dir)
    pub = KVEventPublisher(engine.prefix_cache, engine.registry, "tcp://127.0.0.1:*", "kv")
    with zmq.Context.instance().socket(zmq.SUB) as sub:
        sub.connect(pub.bound)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
        prompt = _tokens(3 * PAGE + 2, 7)
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        engine.add_request({"prompt_token_ids": prompt}, params)
        sent = 0
        while engine.has_unfinished_requests():
            engine.step()
            sent += pub.flush()
        assert sent > 0
        got = []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
            if sum(len(b[1]) for _, b in got) == sent:
                break
        pub.close()
    assert [s for s, _ in got] == list(range(1, len(got) + 1))
    events = [e for _, batch in got for e in batch[1]]
    assert all(isinstance(batch[0], float) for _, batch in got)
    assert {e["type"] for e in events} == {"BlockStored"}
    full = engine.registry.get("target.full").owner
    groups = {e["group_idx"] for e in events}
    assert len(groups) == len(_paged(engine))
    mine = [e for e in events if e["kv_cache_spec_kind"] == "full_attention"]
    assert {h for e in mine for h in e["block_hashes"]} == {block_hash(k) for k in full.cached}
    first = next(e for e in mine if e["parent_block_hash"] is None)
    assert first["token_ids"] == prompt[:PAGE] and first["block_size"] == PAGE


def test_a_taken_endpoint_fails_at_the_start(spec_dir):  # noqa: F811
    engine = _engine(spec_dir)
    with zmq.Context.instance().socket(zmq.PUB) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            KVEventPublisher(engine.prefix_cache, engine.registry, f"tcp://127.0.0.1:{port}")
