"""What the engine returns: vLLM-shaped ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class HandoffKind(StrEnum):
    """How a PD decode request got its prompt state: exactly one of these, once."""

    TRANSFERRED = "transferred"
    """A prefill computed it and pushed it here (bytes per component)."""
    LOCAL_PREFILL = "local_prefill"
    """This decode computed the prompt itself (the reason says why)."""
    FAILED = "failed"
    """Neither: the request failed before its first token (the reason says why)."""


class HandoffReason(StrEnum):
    """Why a request was prefilled locally or failed (a bounded set: metric labels)."""

    # local_prefill
    POLICY = "policy"
    """The prompt is at most ``local_prefill_tokens`` long: computing it here is cheaper."""
    NO_HEALTHY_PREFILL = "no_healthy_prefill"
    """No prefill to send it to (none named, none configured, or the router found none)."""
    PREFILL_REFUSED = "prefill_refused"
    """The prefill refused it before writing anything (or refused to pair)."""
    # failed
    PREFILL_FAILED = "prefill_failed"
    """The prefill reported a failure after accepting it (``local_prefill``: a router sent
    the request to a decode alone after the prefills it tried failed it)."""
    PREFILL_UNREACHABLE = "prefill_unreachable"
    """The prefill died, went silent, was fenced, or could not be sent the request."""
    STATE_TIMEOUT = "state_timeout"
    """No state within ``waiting_for_state_s``."""
    BAD_STATE = "bad_state"
    """The state landed but its record did not check out."""
    NO_ROOM = "no_room"
    """Decode can never make room for it."""
    ABORTED = "aborted"
    """The client gave up before the state landed."""


LOCAL_PREFILL_REASONS = frozenset(
    {
        HandoffReason.POLICY,
        HandoffReason.NO_HEALTHY_PREFILL,
        HandoffReason.PREFILL_REFUSED,
        HandoffReason.PREFILL_FAILED,
    }
)
"""The reasons a ``local_prefill`` outcome has (``prefill_refused`` and ``prefill_failed``
end a ``failed`` one too: with the fallback off, or a prefill a router named; a router
that then sends the request to a decode alone names the reason it had)."""


@dataclass(frozen=True)
class HandoffOutcome:
    """The typed end of a PD decode request's handoff (``RequestMetrics.handoff``)."""

    kind: HandoffKind
    reason: HandoffReason | None = None
    """None exactly when ``kind`` is ``transferred``."""
    component_bytes: Mapping[str, int] = field(default_factory=dict)
    """``transferred``: bytes pushed here per state component."""
    detail: str = ""
    """``failed``: the failure in words."""

    def __post_init__(self) -> None:
        if (self.reason is None) != (self.kind is HandoffKind.TRANSFERRED):
            raise ValueError(f"handoff {self.kind} with reason {self.reason!r}")
        if self.kind is HandoffKind.LOCAL_PREFILL and self.reason not in LOCAL_PREFILL_REASONS:
            raise ValueError(f"a local prefill's reason is one of {sorted(LOCAL_PREFILL_REASONS)}")

    @classmethod
    def transferred(cls, component_bytes: Mapping[str, int]) -> HandoffOutcome:
        return cls(HandoffKind.TRANSFERRED, component_bytes=dict(component_bytes))

    @classmethod
    def local_prefill(cls, reason: HandoffReason) -> HandoffOutcome:
        return cls(HandoffKind.LOCAL_PREFILL, reason)

    @classmethod
    def failed(cls, reason: HandoffReason, detail: str = "") -> HandoffOutcome:
        return cls(HandoffKind.FAILED, reason, detail=detail)

    def header(self) -> str:
        """The ``x-baton-handoff`` value: ``transferred; bytes=N; target.full=N; ...``,
        ``local_prefill; reason=policy`` or ``failed; reason=state_timeout``."""
        if self.kind is HandoffKind.TRANSFERRED:
            total = sum(self.component_bytes.values())
            parts = [f"bytes={total}", *(f"{n}={b}" for n, b in self.component_bytes.items())]
            return "; ".join([self.kind.value, *parts])
        return f"{self.kind.value}; reason={self.reason}"

    def __str__(self) -> str:
        text = self.header()
        return f"{text} ({self.detail})" if self.detail else text


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens restored from the prefix cache (not computed)."""
    num_generated_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    """Speculative decoding: tokens committed by each verify step (accepted + 1)."""
    num_draft_tokens: int = 0
    """Draft tokens proposed and verified."""
    accepted_per_position: list[int] = field(default_factory=list)
    """How often the draft token at chain position i was accepted."""
    handoff: HandoffOutcome | None = None
    """PD decode: how the prompt state got here (None on a colocated engine)."""

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens per verify step (the speculative speed-up bound)."""
        if not self.accepted_lengths:
            return None
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


class Prefix:
    """The first ``length`` items of an append-only list (or characters of a ``Text``),
    all it holds now by default: what a step's cumulative output holds instead of a copy of
    every id generated so far (a copy per request and step is quadratic in the output's
    length: ~7 us per step at 4,096 tokens). ``CompletionOutput`` copies it when the field
    is first read."""

    __slots__ = ("items", "length")

    def __init__(self, items: list | Text, length: int | None = None) -> None:
        self.items = items
        self.length = len(items) if length is None else length

    def copy(self) -> list | str:
        assert len(self.items) >= self.length, (
            "a Prefix's items must only grow, not be cut below it"
        )
        return self.items[: self.length]


class Text:
    """A request's text so far, appended piece by piece (``Track.text``): ``text += piece``
    copied the whole text every step -- quadratic in the output's length, ~3-5 us per call
    at 3-4K tokens. The pieces are joined when read (one ``str.join``: atomic for a reader
    on another thread, the server's) and folded into one every ``FOLD`` pieces by the
    engine's thread, the one that appends. ``Track.output``'s cumulative text is a
    ``Prefix`` of it."""

    FOLD = 256

    __slots__ = ("_pieces", "_length")

    def __init__(self, text: str = "") -> None:
        self._pieces = [text] if text else []
        self._length = len(text)

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        return "".join(self._pieces)

    def __repr__(self) -> str:
        return f"Text({str(self)!r})"

    def append(self, piece: str) -> None:
        if not piece:
            return
        pieces = self._pieces
        pieces.append(piece)
        self._length += len(piece)
        if len(pieces) >= self.FOLD:
            self._pieces = ["".join(pieces)]

    def __getitem__(self, key: slice) -> str:
        return str(self)[key]

    def since(self, start: int) -> str:
        """The text from character ``start`` on (0 <= start <= len), joining only the
        pieces that hold it."""
        if not 0 <= start <= self._length:
            raise IndexError(f"start {start} outside text of length {self._length}")
        pieces, need = self._pieces, self._length - start
        taken, i = 0, len(pieces)
        while taken < need:
            i -= 1
            taken += len(pieces[i])
        return "".join(pieces[i:])[taken - need :]

    def cut(self, length: int) -> None:
        """Keep the first ``length`` characters (a stop string's cut)."""
        kept = str(self)[:length]
        self._pieces = [kept] if kept else []
        self._length = len(kept)


@dataclass
class CompletionOutput:
    index: int
    text: str
    """The text generated so far (given as a str or a ``Prefix`` of a ``Text``; always read
    as a str)."""
    token_ids: list[int]
    """The ids generated so far (given as a list or a ``Prefix``; always read as a list)."""
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    """Per generated token: {token id: logprob} of the sampled token and the top-n (given
    as a list or a ``Prefix``, as ``token_ids``)."""
    finish_reason: str | None = None
    """``stop``, ``length``, ``abort`` or None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, if any."""


def _copied_on_read(name: str) -> property:
    """A field that stores a list or str, or a ``Prefix`` of one, and reads as a list or
    str: the copy made once, on the first read."""
    key = f"_{name}"

    def read(self: CompletionOutput) -> list | str | None:
        value = self.__dict__[key]
        if isinstance(value, Prefix):
            value = self.__dict__[key] = value.copy()
        return value

    def write(self: CompletionOutput, value: list | str | Prefix | None) -> None:
        self.__dict__[key] = value

    return property(read, write)


# NOTE: set after the class: a property in its body would be taken for the fields' default.
# The generated __init__, __eq__ and __repr__ read and write through them.
for _name in ("text", "token_ids", "logprobs"):
    setattr(CompletionOutput, _name, _copied_on_read(_name))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    delta: CompletionOutput | None = field(default=None, repr=False)
    """What this step added (text, token ids, logprobs); for streaming."""
    error: str | None = None
    """Why a request with finish reason ``error`` failed (e.g. its prefill worker died)."""
