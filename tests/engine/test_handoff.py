"""The engine's PD handoff: every component declares its own token range, the engine owns
the request lifecycle (queue, reservation, admission, failure, quarantine, release), and a
component nobody else knows about moves through PD with no edit outside its declaration."""

from __future__ import annotations

import pytest
import torch

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.memory.block_pool import BlockPool
from baton.memory.state import (
    ComponentKind,
    PushPhase,
    StateComponent,
    StateRegistry,
    UnitKind,
    UnitRange,
)
from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.request import FinishReason, RequestStatus
from baton.sampling_params import SamplingParams
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.checksums import component_checksums
from baton.transfer.sender import Sender
from tests.transfer.inprocess import InProcessDecode

VOCAB = 256


@pytest.fixture(scope="module")
def pd_dir(hf_checkpoint, tmp_path_factory):
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("handoff-qwen3")
    hf.save_pretrained(directory)
    torch.manual_seed(2)
    draft = MTPDraft(load_model(directory, "float32").spec, DraftSpec(sliding_window=8))
    save_draft(directory, draft, torch.float32)
    return directory


def _config(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs(dtype="float32", page_size=8, max_num_batched_tokens=40, **kw)


def _prompt(n: int, seed: int = 4) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_each_component_declares_its_handoff_range(pd_dir):
    engine = LLMEngine(pd_dir, _config())
    ranges = engine.handoff.token_ranges(21)
    assert ranges == {
        "target.full": (0, 21),
        "target.swa": (0, 21),
        "draft.swa": (0, 20),
        "aux": (0, 0),
    }
    assert [c.name for c in engine.registry.pushed_in(PushPhase.STREAMED)] == ["target.full"]
    assert [c.name for c in engine.registry.pushed_in(PushPhase.LAST)] == ["aux"]
    assert all(c.owner is not None for c in engine.registry)


def test_decode_queues_what_does_not_fit_and_owns_every_transition(pd_dir):
    engine = LLMEngine(pd_dir, _config(max_num_seqs=1))
    handoff, params = engine.handoff, SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        handoff.add_for_decode({"prompt_token_ids": [VOCAB]}, params, "bad")
    assert "bad" not in engine.tracks and handoff.queued == []
    for request_id in ("a", "b"):
        handoff.add_for_decode({"prompt_token_ids": _prompt(19)}, params, request_id)
    (first,) = handoff.reserve_queued()  # max_num_seqs=1: "b" waits, no error
    assert first.request_id == "a" and first.params.seed is not None
    assert engine.tracks["a"].request.status is RequestStatus.WAITING_FOR_STATE
    assert engine.tracks["b"].request.status is RequestStatus.WAITING_FOR_UNITS
    assert handoff.reserve_queued() == [] and handoff.queued == ["b"]
    held = engine.units_in_use()
    assert held["target.full"] == 3 and held["aux"] == 1 and held["draft.swa"] > 0

    # A failure while a prefill may still write: the units stay, quarantined.
    out = handoff.fail("a", "prefill went silent", stopped_writing=False)
    assert out.finished and out.error == "prefill went silent"
    assert out.outputs[0].finish_reason == FinishReason.ERROR.value
    assert engine.quarantined == {"a"} and engine.units_in_use() == held
    with pytest.raises(ValueError, match="already in use"):
        handoff.add_for_decode({"prompt_token_ids": [1]}, params, "a")
    (second,) = handoff.reserve_queued()  # a quarantined request runs nothing
    assert second.request_id == "b"
    handoff.release("a")  # the prefill confirmed it stopped writing
    assert "a" not in engine.quarantined

    # Aborting a queued request frees nothing it never had; a waiting one is quarantined.
    handoff.add_for_decode({"prompt_token_ids": _prompt(5)}, params, "c")
    assert engine.abort_request("c").outputs[0].finish_reason == FinishReason.ABORT.value
    assert handoff.queued == [] and "c" not in engine.quarantined
    engine.abort_request("b")
    assert engine.quarantined == {"b"}
    handoff.release("b")
    assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()
    assert not engine.tracks and not engine.has_unfinished_requests()


# -- a component only its declaration knows about ------------------------------------------
ROW_FLOATS = 16


class RecurrentRows:
    """A fake per-request recurrent state: one row per request, rewritten as the prompt is
    computed. Only the prefill's instance writes (``is_writer``): decode's row can hold the
    prefill's bytes only if the handoff moved them."""

    def __init__(self, registry: StateRegistry, num_rows: int, is_writer: bool) -> None:
        self.storage = torch.zeros(num_rows, ROW_FLOATS)
        self.blocks = BlockPool(num_rows)
        self.rows: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}
        self.is_writer = is_writer
        self.component = StateComponent(
            name="target.recurrent",
            kind=ComponentKind.ROW,
            layer_ids=(),
            unit=UnitKind.ROW,
            unit_bytes=ROW_FLOATS * 4,
            num_units=num_rows,
            dtype="float32",
            unit_shape=(ROW_FLOATS,),
            storage=self.storage,
            index=self.index,
            owner=self,
        )
        registry.register(self.component)

    @property
    def num_free_units(self) -> int:
        return self.blocks.num_free

    def num_new_units(self, request_id: str, start: int, end: int) -> int:
        return 0 if request_id in self.rows else 1

    def grow(self, request_id: str, start: int, end: int) -> None:
        if request_id not in self.rows:
            self.rows[request_id] = self.blocks.allocate(1)[0]

    def trim(self, request_id: str, num_computed: int) -> None:
        self.num_tokens[request_id] = num_computed
        if self.is_writer and request_id in self.rows:
            self.storage[self.rows[request_id]] = torch.arange(ROW_FLOATS) * num_computed + 0.5

    def free(self, request_id: str) -> None:
        if request_id in self.rows:
            self.blocks.free([self.rows.pop(request_id)])
        self.num_tokens.pop(request_id, None)

    def peak_units(self, num_tokens: int) -> int:
        return 1

    def index(self, request_id: str) -> UnitRange:
        row = self.rows.get(request_id)
        return UnitRange((row,) if row is not None else (), 0, self.num_tokens.get(request_id, 0))

    def handoff_units(self, request_id: str, end: int) -> tuple[int, ...]:
        return self.index(request_id).unit_ids  # one row holds the whole range

    def num_leading_cached(self, end: int, num_cached: int) -> int:
        return 0  # not cached (``Caching.NONE``)


def _recurrent(is_writer: bool):
    def factory(registry, config, allocator):
        return RecurrentRows(registry, 2 * config.scheduler.max_num_seqs, is_writer)

    return factory


def _pd_with_extra(pd_dir, skip=frozenset()):
    prefill_engine = LLMEngine(pd_dir, _config(), extra_state=[_recurrent(True)])
    decode_engine = LLMEngine(pd_dir, _config(), extra_state=[_recurrent(False)])
    receiver = LoopbackBackend()
    regions = {
        c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
    }
    sender = Sender(prefill_engine, LoopbackBackend())
    sender.keep_checksums = True
    sender.debug_skip_components = frozenset(skip)
    sender.connect(regions)
    decode = InProcessDecode(decode_engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rooms = {}
    for room, n in enumerate((5, 8, 30), start=7):
        msg = decode.reserve(room, _prompt(n, room), params)
        rooms[room] = msg.request_id
        assert sender.on_reserve(msg) is None
    arrived, done = {}, {}
    while sender.outgoing or decode_engine.has_unfinished_requests():
        for reply in sender.step():
            assert not hasattr(reply, "reason"), reply
            arrived[reply.room] = component_checksums(decode_engine, rooms[reply.room])
            decode.on_done(reply)
        done.update({o.request_id: o for o in decode_engine.step() if o.finished})
    return sender, decode, arrived, [done[rooms[r]] for r in sorted(rooms)], decode_engine


def test_an_extra_component_moves_through_pd_with_no_edit_elsewhere(pd_dir):
    sender, decode, arrived, outs, decode_engine = _pd_with_extra(pd_dir)
    assert "target.recurrent" in decode_engine.registry
    assert decode.bytes_received["target.recurrent"] == 3 * ROW_FLOATS * 4  # one row each
    for room, sums in arrived.items():
        assert sums == sender.checksums[room], room  # every component, the new one included
    # Its bytes are the prefill's (decode's instance never writes): moved, not recomputed.
    assert decode_engine.runner.num_computed_prompt_tokens == 0
    colocated = LLMEngine(pd_dir, _config())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [
        colocated.add_request({"prompt_token_ids": _prompt(n, r)}, params)
        for r, n in enumerate((5, 8, 30), start=7)
    ]
    done = {}
    while colocated.has_unfinished_requests():
        done.update({o.request_id: o for o in colocated.step() if o.finished})
    assert [o.outputs[0].token_ids for o in outs] == [done[i].outputs[0].token_ids for i in ids]
    assert all(n == 0 for n in decode_engine.units_in_use().values())


def test_a_skipped_extra_component_is_caught_by_the_checksums(pd_dir):
    sender, _, arrived, _, _ = _pd_with_extra(pd_dir, skip={"target.recurrent"})
    for room, sums in arrived.items():
        differ = {n for n in sums if sums[n] != sender.checksums[room][n]}
        assert differ == {"target.recurrent"}, (room, differ)
