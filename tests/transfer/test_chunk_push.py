"""PD pushes as prefill chunks complete, and the deadline of one transfer.

With a small chunk budget and a long prompt, ``Sender`` must push the target's
full-attention pages in several batches *before* the last chunk (each page once, into the
unit decode reserved for it), the sliding / ring / draft components only at the end, the
aux record last -- and decode's outputs and every component's bytes still equal a
colocated engine's and prefill's. A failed chunk batch fails its requests once nothing is
in flight; a batch that outlives ``transfer_s`` fails them without claiming that writing
stopped, and confirms it once the backend ends the batch. A room decode gave up on (a Fence
or Abort read right before a batch) is not pushed at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.sampling_params import SamplingParams
from baton.transfer.backends.base import TransferOp, failed
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.checksums import component_checksums
from baton.transfer.protocol import StateDone, StateFailed
from baton.transfer.sender import Sender
from tests.transfer.inprocess import InProcessDecode

VOCAB = 256
LENGTHS = [150, 5, 37]  # many chunks, shorter than a page, a few pages
BUDGET = 16  # max_num_batched_tokens: 150 tokens take ten steps
PAGE = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, seed=3, ignore_eos=True)


class RecordingBackend(LoopbackBackend):
    """Loopback that logs every batch (``batches``) and can fail the ``fail_at``-th."""

    def __init__(self, *, deferred: bool = False, fail_at: int | None = None) -> None:
        super().__init__(deferred=deferred)
        self.batches: list[list[TransferOp]] = []
        self.fail_at = fail_at

    def _start(self, transfer_id: int, batch: Sequence[TransferOp]) -> None:
        self.batches.append(list(batch))
        if len(self.batches) - 1 == self.fail_at:
            self._finish(transfer_id, failed("loopback: injected failure"))
        else:
            super()._start(transfer_id, batch)


@pytest.fixture(scope="module")
def pd_dir(hf_checkpoint, tmp_path_factory):
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("chunk-push-qwen3")
    hf.save_pretrained(directory)
    torch.manual_seed(2)
    draft = MTPDraft(load_model(directory, "float32").spec, DraftSpec(sliding_window=8))
    save_draft(directory, draft, torch.float32)
    return directory


def _config(mode: str = "paged") -> EngineConfig:
    return EngineConfig.from_kwargs(
        dtype="float32", page_size=PAGE, sliding_mode=mode, max_num_batched_tokens=BUDGET
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


class _Pair:
    """A prefill worker over ``backend`` and a decode worker, both on fresh engines."""

    def __init__(self, directory, mode: str, backend: LoopbackBackend) -> None:
        self.prefill_engine = LLMEngine(directory, _config(mode))
        self.decode_engine = LLMEngine(directory, _config(mode))
        self.receiver = LoopbackBackend()
        regions = {
            c.name: self.receiver.register(c.name, c.storage).to_dict()
            for c in self.decode_engine.registry
        }
        self.backend = backend
        self.sender = Sender(self.prefill_engine, backend)
        self.sender.keep_checksums = True
        self.sender.connect(regions)
        self.decode = InProcessDecode(self.decode_engine)
        self.rooms: dict[int, str] = {}

    def reserve(self, prompts: list[list[int]]) -> None:
        for room, prompt in enumerate(prompts, start=10):
            msg = self.decode.reserve(room, prompt, PARAMS)
            self.rooms[room] = msg.request_id
            assert self.sender.on_reserve(msg) is None

    def unit_ids(self, engine: LLMEngine, name: str, room: int) -> list[int]:
        return list(engine.registry.get(name).index(self.rooms[room]).unit_ids)


def _colocated(directory, mode: str) -> list[list[int]]:
    engine = LLMEngine(directory, _config(mode))
    ids = [engine.add_request({"prompt_token_ids": p}, PARAMS) for p in _prompts()]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i].outputs[0].token_ids for i in ids]


def _regions(batch: list[TransferOp]) -> set[str]:
    return {op.dst_region for op in batch}


@pytest.mark.parametrize("mode", ["paged", "ring"])
def test_full_pages_stream_before_the_last_chunk(pd_dir, mode):
    pair = _Pair(pd_dir, mode, RecordingBackend())
    pair.reserve(_prompts())
    long_room = 10
    unit_bytes = pair.prefill_engine.registry.get("target.full").unit_bytes
    done: dict[int, StateDone] = {}
    arrived, outputs = {}, {}
    batches_before_done: int | None = None
    while pair.sender.outgoing or pair.decode_engine.has_unfinished_requests():
        num_batches = len(pair.backend.batches)
        for reply in pair.sender.step():
            assert isinstance(reply, StateDone), reply
            done[reply.room] = reply
            arrived[reply.room] = component_checksums(pair.decode_engine, pair.rooms[reply.room])
            pair.decode.on_done(reply)
            if reply.room == long_room:  # this step ran its last chunk
                batches_before_done = num_batches
        outputs.update({o.request_id: o for o in pair.decode_engine.step() if o.finished})

    # Outputs equal colocated; every component arrived byte-identical.
    tokens = [outputs[pair.rooms[r]].outputs[0].token_ids for r in sorted(pair.rooms)]
    assert tokens == _colocated(pd_dir, mode)
    for room, sums in arrived.items():
        assert sums == pair.sender.checksums[room], room

    # Before the long prompt's last chunk, several batches carried only full-attention pages.
    assert batches_before_done is not None
    early = pair.backend.batches[:batches_before_done]
    streamed = [b for b in early if "target.full" in _regions(b)]
    assert len(streamed) >= 3, [_regions(b) for b in pair.backend.batches]
    assert all(_regions(b) == {"target.full"} for b in streamed)
    # ...and no destination byte was written twice (each page pushed once).
    written = sorted(
        (op.dst_offset, op.nbytes)
        for b in pair.backend.batches
        for op in b
        if op.dst_region == "target.full"
    )
    for (offset, nbytes), (next_offset, _) in zip(written, written[1:], strict=False):
        assert offset + nbytes <= next_offset
    # Per-component counters: the whole state, counted across every batch.
    for room, length in zip(sorted(pair.rooms), LENGTHS, strict=True):
        stats = done[room].component_stats
        assert stats["target.full"].num_bytes == math.ceil(length / PAGE) * unit_bytes
        assert all(s.seconds > 0 for s in stats.values() if s.num_bytes)
    assert sum(n for _, n in written) == sum(
        done[r].component_stats["target.full"].num_bytes for r in done
    )
    assert pair.decode.bytes_received["target.full"] == sum(written_n for _, written_n in written)
    for engine in (pair.prefill_engine, pair.decode_engine):
        for cache in engine.caches:
            assert cache.num_free_units() == {p.name: p.component.num_units for p in cache.pools}


def test_a_preempted_prompt_sends_its_pages_again(pd_dir):
    pair = _Pair(pd_dir, "paged", RecordingBackend())
    pair.reserve(_prompts()[:1])
    for _ in range(4):
        assert pair.sender.step() == []
    sent_before = sum(op.nbytes for b in pair.backend.batches for op in b)
    assert sent_before > 0
    # Memory ran out (say): the scheduler preempts it; it is recomputed into other pages.
    request = pair.prefill_engine.tracks[pair.rooms[10]].request
    pair.prefill_engine.scheduler._preempt(request)
    replies = []
    while not replies:
        replies = pair.sender.step()
    (reply,) = replies
    assert isinstance(reply, StateDone)
    arrived = component_checksums(pair.decode_engine, pair.rooms[10])
    assert arrived == pair.sender.checksums[10]
    unit_bytes = pair.prefill_engine.registry.get("target.full").unit_bytes
    full_bytes = math.ceil(LENGTHS[0] / PAGE) * unit_bytes
    assert reply.component_stats["target.full"].num_bytes == full_bytes + sent_before


def test_a_failed_chunk_batch_fails_the_request_once_nothing_is_in_flight(pd_dir):
    pair = _Pair(pd_dir, "paged", RecordingBackend(fail_at=1))
    pair.reserve(_prompts()[:1])
    assert pair.sender.step() == []  # the first pages went out
    (reply,) = pair.sender.step()  # the second batch fails
    assert isinstance(reply, StateFailed)
    assert reply.stopped_writing and "injected" in reply.reason
    assert not pair.sender.outgoing
    assert not pair.backend._status  # every transfer ended and was released
    engine = pair.prefill_engine
    assert not engine.has_unfinished_requests() and not engine.held
    for cache in engine.caches:
        assert cache.num_free_units() == {p.name: p.component.num_units for p in cache.pools}
    assert engine.aux.num_free_units == engine.aux.component.num_units


def test_a_transfer_past_its_deadline_fails_without_claiming_it_stopped(pd_dir):
    backend = RecordingBackend(deferred=True)  # polls stay PENDING until completed
    pair = _Pair(pd_dir, "paged", backend)
    pair.sender.batches.transfer_s = 0.05
    pair.reserve(_prompts()[:1])
    (reply,) = pair.sender.step()
    assert isinstance(reply, StateFailed)
    assert not reply.stopped_writing
    assert "0.05 s" in reply.reason
    assert not pair.sender.outgoing
    assert pair.sender.step() == []  # still held by the backend: nothing to confirm yet
    backend.complete_pending()
    (confirm,) = pair.sender.push_ready()
    assert isinstance(confirm, StateFailed)
    assert confirm.room == reply.room and confirm.stopped_writing
    assert not backend._status
    assert pair.sender.push_ready() == []


@pytest.mark.parametrize("how", ["fence", "abort"])
@pytest.mark.parametrize("index", [0, 1], ids=["streaming", "final-push"])
def test_a_room_given_up_right_before_its_push_is_not_written(pd_dir, how, index):
    """Decode's Fence (or Abort) read right before a batch -- say the prefill was paused
    and resumed inside a step -- stops that room's pushes: no batch carries it any more, its
    prefill units come back and the answer confirms that nothing writes. Checked while the
    prompt streams its pages (150 tokens) and at its final push (5 tokens, one step)."""
    pair = _Pair(pd_dir, "paged", RecordingBackend())
    pair.reserve(_prompts()[index : index + 1])
    if index == 0:
        assert pair.sender.step() == []  # the first chunk's pages went out
        assert pair.backend.batches
    num_batches = len(pair.backend.batches)

    def give_up() -> None:  # what the server's read of its channel marks on the sender
        if how == "fence":
            pair.sender.fence_epoch = 1  # the room was reserved under epoch 0
        else:
            pair.sender.aborted.add(10)

    pair.sender.refresh_fences = give_up
    (reply,) = pair.sender.step()
    assert isinstance(reply, StateFailed) and reply.room == 10
    assert reply.stopped_writing and "not written" in reply.reason
    assert len(pair.backend.batches) == num_batches  # checked before the batch: none went out
    assert not pair.sender.outgoing and not pair.sender.aborted
    engine = pair.prefill_engine
    assert not engine.has_unfinished_requests() and not engine.held
    for cache in engine.caches:
        assert cache.num_free_units() == {p.name: p.component.num_units for p in cache.pools}
    assert engine.aux.num_free_units == engine.aux.component.num_units
