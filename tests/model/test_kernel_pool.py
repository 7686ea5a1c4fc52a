"""The small-step thread pool (baton/kernels/pool.c) under linear.c's matmul.

Which thread computes a block never changes its bits, so every result here must equal the
one-thread result exactly: with helpers, with more threads than cores, from two Python
threads at once, with every thread squeezed onto one core, and in a forked child (which has
none of its parent's helpers). And the helpers really take tasks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

import baton.kernels as kernels
from baton.kernels import library
from baton.kernels.linear import MAX_ROWS, PackedRows, linear_rows

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
pytestmark = pytest.mark.skipif(library() is None, reason=OFF)


@pytest.fixture
def threads():
    """Set the small-step threads for the test; restored after."""
    yield kernels.set_small_step_threads
    kernels.set_small_step_threads(None)


def _case(seed: int, rows: int = MAX_ROWS, k: int = 768, n: int = 768):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, rows, k, generator=g), PackedRows(torch.randn(n, k, generator=g) / k**0.5)


def _alone(x, w):
    kernels.set_small_step_threads(1)
    try:
        return linear_rows(x, w, None)
    finally:
        kernels.set_small_step_threads(None)


def test_helpers_take_tasks_and_change_no_bit(threads):
    cases = [_case(seed) for seed in range(8)]
    want = [_alone(x, w) for x, w in cases]
    before = library().baton_pool_helper_tasks()
    threads(2)
    for _ in range(5):
        for (x, w), expected in zip(cases, want, strict=True):
            assert torch.equal(linear_rows(x, w, None), expected)
    assert library().baton_pool_helper_tasks() > before, "no helper ever took a task"


def test_more_threads_than_cores(threads):
    x, w = _case(1)
    want = _alone(x, w)
    threads(4 * (os.cpu_count() or 1))
    for _ in range(20):
        assert torch.equal(linear_rows(x, w, None), want)


def test_two_python_threads_calling_at_once(threads):
    cases = [_case(seed, rows=rows) for seed, rows in ((2, 16), (3, 4))]
    want = [_alone(x, w) for x, w in cases]
    threads(2)
    wrong: list[int] = []

    def loop(i: int) -> None:
        x, w = cases[i]
        for _ in range(100):
            if not torch.equal(linear_rows(x, w, None), want[i]):
                wrong.append(i)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert not any(t.is_alive() for t in workers), "a call hung"
    assert not wrong


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_every_thread_on_one_core(threads):
    """Helpers that share the caller's core (off it most of the time): nothing hangs and the
    results stay exact."""
    x, w = _case(4)
    want = _alone(x, w)
    threads(2)
    linear_rows(x, w, None)  # the helper exists
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    kept = {tid: os.sched_getaffinity(tid) for tid in tids}
    one = {min(os.sched_getaffinity(0))}
    try:
        for tid in tids:
            os.sched_setaffinity(tid, one)
        start = time.monotonic()
        for _ in range(200):
            assert torch.equal(linear_rows(x, w, None), want)
        assert time.monotonic() - start < 30
    finally:
        for tid, cpus in kept.items():
            with contextlib.suppress(OSError):  # that thread has ended
                os.sched_setaffinity(tid, cpus)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_computes_without_its_parents_helpers(threads):
    # 32 rows: torch's own ops on more than 32 K elements (torch.equal here) run on OpenMP,
    # whose threads a forked child of a process that used them cannot start (libgomp hangs);
    # the pool is what is tested.
    x, w = _case(5, rows=32)
    want = _alone(x, w)
    threads(2)
    assert torch.equal(linear_rows(x, w, None), want)  # the parent's helpers run
    pid = os.fork()
    if pid == 0:  # the child: its own helpers, or inline; never a wait for the parent's
        ok = all(torch.equal(linear_rows(x, w, None), want) for _ in range(20))
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the child computed wrong results"
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in the pool")


def test_inline_small_calls_keeps_the_helpers_out_and_the_bits(threads):
    """``inline_small_calls`` (the runner's, after a step's prompt matmuls): every task on
    the calling thread, the same result; the setting comes back when it ends, raising or
    not."""
    cases = [_case(seed) for seed in range(4)]
    want = [_alone(x, w) for x, w in cases]
    threads(2)
    before = library().baton_pool_helper_tasks()
    with kernels.inline_small_calls():
        assert kernels.small_step_threads() == 1
        for _ in range(5):
            for (x, w), expected in zip(cases, want, strict=True):
                assert torch.equal(linear_rows(x, w, None), expected)
    assert library().baton_pool_helper_tasks() == before, "a helper took a task"
    assert kernels.small_step_threads() == 2
    with contextlib.suppress(RuntimeError), kernels.inline_small_calls():
        raise RuntimeError
    assert kernels.small_step_threads() == 2
    with kernels.inline_small_calls(active=False):
        assert kernels.small_step_threads() == 2


def test_a_prompt_steps_call_on_openmps_threads_changes_no_bit():
    """A large call among torch's ops (``kernels.prompt_step_threads``: negated, linear.c
    runs it on OpenMP's threads, pool.c's ``baton_parallel_openmp``) gives the one-thread
    bits -- any number of rows, with torch's threads at 1, 2 and more than the cores,
    right after a torch op that used OpenMP's threads, and from two Python threads at
    once (each its own OpenMP team) -- and the pool's helpers take none of its tasks."""
    cases = [_case(seed, rows=rows, n=1024) for seed, rows in enumerate((1, 7, 200, 301))]
    kernels.set_small_step_threads(1)
    try:
        want = [linear_rows(x, w, None, max_rows=None) for x, w in cases]
    finally:
        kernels.set_small_step_threads(None)
    before = torch.get_num_threads()
    try:
        for count in (1, 2, 3 * (os.cpu_count() or 1)):
            torch.set_num_threads(count)
            helper_tasks = library().baton_pool_helper_tasks()
            for (x, w), expected in zip(cases, want, strict=True):
                torch.nn.functional.silu(torch.randn(256, 4096))  # OpenMP's workers spin now
                got = linear_rows(x, w, None, max_rows=None, threads=kernels.prompt_step_threads())
                assert torch.equal(got, expected), (count, x.shape)
            assert library().baton_pool_helper_tasks() == helper_tasks
        torch.set_num_threads(2)
        results: dict[int, bool] = {}

        def call(i: int) -> None:
            ok = True
            for _ in range(10):
                for (x, w), expected in zip(cases, want, strict=True):
                    got = linear_rows(x, w, None, max_rows=None, threads=-2)
                    ok = ok and torch.equal(got, expected)
            results[i] = ok

        workers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=120)
        assert results == {0: True, 1: True}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_small_steps_norms_and_argmax_run_on_the_pool_and_change_no_bit(threads, dtype):
    """Wide norms and argmaxes inside a small step (``layer.c``'s, ``chain.c``'s: ``pooled``)
    run on pool.c's threads, not OpenMP's -- an OpenMP region there woke torch's worker onto
    the helper's core (norm.c's ``run_norm``) -- with the one-thread bits, and the OpenMP
    path's (the Python callers')."""
    from baton.kernels.logits import argmax_rows
    from baton.kernels.norm import rms_norm, rms_norm_rotary

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1024, 1024, generator=g).to(dtype)  # > 32 K elements: wide
    weight = torch.randn(1024, generator=g).to(dtype)
    heads = torch.randn(1, 256, 24, 128, generator=g).to(dtype)  # Qwen3-0.6B's q|k heads
    head_weight = torch.randn(24, 128, generator=g).to(dtype)
    cos = torch.randn(1, 256, 1, 128, generator=g).to(dtype)
    sin = torch.randn(1, 256, 1, 128, generator=g).to(dtype)
    scores = torch.randn(32, 50000, generator=g).to(dtype)

    def calls(pooled: bool) -> list[torch.Tensor]:
        return [
            rms_norm(x, weight, 1e-6, 0.0, pooled=pooled),
            rms_norm_rotary(heads, head_weight, 1e-6, cos, sin, pooled=pooled),
            *argmax_rows(scores, pooled=pooled),
        ]

    threads(1)
    alone = calls(pooled=True)
    threads(2)
    before = library().baton_pool_helper_tasks()
    for _ in range(50):  # until a helper, woken by the first calls, has taken a task
        for got, want in zip(calls(pooled=True), alone, strict=True):
            assert torch.equal(got, want)
        if library().baton_pool_helper_tasks() > before:
            break
    assert library().baton_pool_helper_tasks() > before, "no helper took a norm's task"
    before = library().baton_pool_helper_tasks()
    for got, want in zip(calls(pooled=False), alone, strict=True):
        assert torch.equal(got, want)
    assert library().baton_pool_helper_tasks() == before, "the OpenMP path used the pool"
