"""``AsyncEngine``: one engine core (``baton.engine.core.EngineCore``: a colocated
``LLMEngine`` or a PD ``DecodeEngine``) driven by one thread -- the engine thread: a
background one (``start``), or the caller's (``run_here``: ``baton serve`` runs it on the
main thread and HTTP on another) -- fed from asyncio.

The engine is not thread-safe, so only the engine thread touches it. Coroutines send
commands (add / abort / stop) through a thread-safe queue; the thread blocks on that queue
while there is no work (no spinning), otherwise steps the engine and hands each
``RequestOutput`` back to the request's asyncio queue: one ``loop.call_soon_threadsafe`` per
event loop per step (``_dispatch``).
Aborts (a client that left) are commands too, so they apply between steps, never inside one.
A request of several samples (``n``, ``best_of``) is fanned out into child requests and its
outputs folded back by ``ParallelSampling`` (``engine/parallel_sampling.py``), which the
thread calls in the engine's place; aborting the request aborts every child.

If the engine loop raises, every request in flight ends with an ``EngineFailed`` naming the
exception, every ``add`` still queued or made later raises ``RuntimeError``, and
``on_failure`` is called: the CLI stops the server and exits non-zero, so that a supervisor
restarts it -- never a process that stays up serving nothing.

Who calls it: ``baton.server.api`` (one per server) and tests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from baton.engine.core import EngineCore, PDRoute
from baton.engine.keep_warm import KeepWarm
from baton.engine.outputs import RequestOutput
from baton.engine.parallel_sampling import ParallelSampling
from baton.engine.stats import EngineStats
from baton.sampling_params import InvalidRequest, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    prompt: str | list[int] | dict
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    accepted: Future
    route: PDRoute | None
    """PD decode: what the router chose (None otherwise)."""


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class EngineFailed(RuntimeError):
    """The engine loop raised: what every request in flight gets (the server then exits)."""


class InjectedFault(RuntimeError):
    """Raised in the engine loop by ``fail_after_steps`` (tests of the failure path)."""


class AsyncEngine:
    """Owns the engine thread. ``await add(...)`` validates the request on that thread
    (raising the engine's ``ValueError`` for a bad one) and returns an async iterator of its
    outputs; closing or cancelling the iterator before the last output aborts the request.
    """

    def __init__(
        self,
        engine: EngineCore,
        on_failure: Callable[[], None] | None = None,
        fail_after_steps: int | None = None,
        keep_warm_s: float = 0.0,
        after_step: Callable[[], object] | None = None,
    ) -> None:
        """``on_failure``: called on the engine thread once the loop raised and every request
        was failed (the CLI stops the server there). ``fail_after_steps``: tests only, the
        loop raises ``InjectedFault`` after this many engine steps. ``keep_warm_s``: how long
        after its last step the idle loop keeps torch's threads warm (``KeepWarm``).
        ``after_step``: called on the engine thread after every step (KV events)."""
        self.engine = engine
        self.requests = ParallelSampling(engine)
        """The engine, taking requests of several samples: what the thread adds, steps and
        aborts through."""
        self.warm = KeepWarm(keep_warm_s)
        self.on_failure = on_failure
        self.fail_after_steps = fail_after_steps
        self.after_step = after_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # NOTE: ``add`` checks ``_closed`` and queues under this lock, and the thread sets it
        # under the lock before failing what is queued: no command can be left unanswered.
        self._lock = threading.Lock()
        self._closed = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self.error: BaseException | None = None
        """Set when the engine thread died; the server reports unhealthy from then on."""
        self.stats = EngineStats(0, 0, {})
        """The engine's snapshot after its last step (the engine thread writes it; /metrics
        reads it)."""

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def run_here(self) -> None:
        """Run the engine loop on the calling thread until ``stop_soon`` or a failure (instead
        of ``start``). A server calls it on the main thread and serves HTTP from another:
        MKL's matmuls run ~1.45x slower on any other thread here (a 128-token prefill step
        29-40 vs 20-24 ms; decode steps, on baton's own kernels, are not slower)."""
        self._thread = threading.current_thread()
        self._run()

    def stop_soon(self) -> None:
        """Ask the loop to stop after the commands queued before this one (any thread)."""
        self._commands.put(_Stop())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still running end with an error on their iterators."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self.stop_soon()
            self._thread.join(timeout_s)

    @property
    def is_pd(self) -> bool:
        """Whether the engine is a PD decode (requests may name their prefill and room)."""
        return self.engine.is_disaggregated

    async def add(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        route: PDRoute | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``route``: a PD decode's routing (``DecodeEngine.add_request``; ``ValueError`` on
        a colocated engine)."""
        if route is not None and not self.is_pd:
            raise ValueError(f"this server is colocated; it takes no PD routing ({route})")
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = await self._tokenize(prompt, loop)
        outputs: asyncio.Queue = asyncio.Queue()
        accepted: Future = Future()
        with self._lock:
            if self._closed or self.error is not None:
                raise RuntimeError("the engine thread is not running")
            self._commands.put(_Add(prompt, params, loop, outputs, accepted, route))
        # the engine's id (re-raises the engine's ValueError)
        request_id = await asyncio.wrap_future(accepted)
        return self._iterate(request_id, outputs)

    async def _tokenize(self, text: str, loop: asyncio.AbstractEventLoop) -> dict:
        """Tokenize off the engine thread and the event loop (a 10 MB prompt held every
        request for 11 s): ``_encode_bounded`` in an executor."""
        token_ids = await loop.run_in_executor(None, self._encode_bounded, text)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _encode_bounded(self, text: str) -> list[int]:
        """The text's token ids, after refusing, without tokenizing, a text too long for the
        context whatever its tokens (``Tokenizer.max_token_bytes``, found once, here too:
        it decodes the whole vocabulary)."""
        tokenizer = self.tokenizer
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        at_least = num_bytes // tokenizer.max_token_bytes
        if at_least > self.max_model_len:
            raise InvalidRequest(
                f"the prompt is {num_bytes} bytes, at least {at_least} tokens; the context is "
                f"{self.max_model_len}",
                "prompt",
            )
        return tokenizer.encode(text)

    async def _iterate(
        self, request_id: str, outputs: asyncio.Queue
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            # NOTE: reached on a client disconnect too (CancelledError / GeneratorExit).
            if not finished:
                self._commands.put(_Abort(request_id))

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        num_steps = 0
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    break
                if self.engine.has_unfinished_requests():
                    if num_steps == self.fail_after_steps:
                        raise InjectedFault(f"injected after {num_steps} engine steps")
                    self._dispatch(self.requests.step())
                    self.warm.busy()
                    if self.after_step is not None:
                        self.after_step()
                    num_steps += 1
                self.stats = self.engine.stats()
        except Exception as exc:
            logger.exception("the engine thread failed")
            self.error = EngineFailed(f"the engine failed ({type(exc).__name__}: {exc})")
            self.error.__cause__ = exc
        finally:
            with self._lock:
                self._closed = True
            self._fail_all(self.error or RuntimeError("the engine was shut down"))
        if self.error is not None and self.on_failure is not None:
            self.on_failure()

    def _drain(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if ``block``, keeping the threads
        warm meanwhile); False on stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=self.warm.wait_s())
            except queue.Empty:
                if not block:
                    return True
                self.warm.tick()
                continue
            block = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Abort):
                self._streams.pop(command.request_id, None)
                self.requests.abort_request(command.request_id)
                continue
            try:
                request_id = self.requests.add_request(
                    command.prompt, command.params, route=command.route
                )
            except Exception as exc:
                command.accepted.set_exception(exc)
                continue
            self._streams[request_id] = (command.loop, command.outputs)
            command.accepted.set_result(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their asyncio queues: one ``call_soon_threadsafe`` per
        event loop per step, not per output: each call wakes the loop with a socket write,
        and at concurrency 8 ~10% of the engine thread's py-spy samples sat in those writes
        (served throughput at 8, 9 alternating pairs on a Zen 4: 0.95-1.17x, median 1.02x)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            loop, outputs_queue = stream
            by_loop.setdefault(loop, []).append((outputs_queue, out))
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, deliveries)
            except RuntimeError:  # its event loop is closed: nobody is listening any more
                for _, out in deliveries:
                    self._streams.pop(out.request_id, None)
                    self.requests.abort_request(out.request_id)

    def _fail_all(self, error: BaseException) -> None:
        """End every request: those running (their units freed, when the engine still can)
        and those whose ``add`` is still queued."""
        for request_id, (loop, outputs_queue) in list(self._streams.items()):
            try:
                self.requests.abort_request(request_id)
            except Exception:  # a failed engine may not free cleanly; the answer matters more
                logger.exception("aborting %s after the failure", request_id)
            if not loop.is_closed():
                loop.call_soon_threadsafe(outputs_queue.put_nowait, error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.accepted.set_exception(RuntimeError("the engine thread is not running"))


def _deliver(deliveries: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On the event loop: put each of a step's outputs on its request's queue."""
    for outputs_queue, out in deliveries:
        outputs_queue.put_nowait(out)
