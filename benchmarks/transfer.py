"""Per-request state transfer: the PD handoff's bytes per second, against the limits.

For prompts of 1k, 4k and 16k tokens, the state of one request -- every component the
registry declares (target full-attention pages, target sliding-window pages, the draft's
sliding-window pages) -- is planned into coalesced runs and pushed through a backend into
a second engine's pools, exactly as ``Sender`` does (no model compute: the pools
are filled with random bytes). In the same run, for the same number of bytes:

- (a) the same backend moving one contiguous buffer in 1 MiB runs ("raw"),
- (b) memcpy (``torch`` copy of a contiguous buffer) and a loopback TCP socket.

Reported: GB/s, the ratios state/raw and state/memcpy, run count and mean run size.
Targets (issue 5): >= 80% of raw backend; shm >= 50% of memcpy.

The cross-host engines (``nixl``, ``mooncake``) move bytes between two processes, as in
``tests/transfer/test_real_backends.py``: this process is decode (it registers the decode
engine's pools and the raw destination), a child (``transfer.py --peer``) is prefill: it
registers source regions filled with seeded random bytes, connects, and pushes the state
batch and the raw batch in turns; this process then checks every landed byte. A backend
that cannot be built here is skipped with the reason printed.

    python benchmarks/transfer.py [--backends shm,loopback,nixl,mooncake]
        [--lengths 1024,4096,16384] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

# NOTE: before UCX loads (nixl), or every process crashes at exit without InfiniBand.
os.environ.setdefault("UCX_MODULES", "^ib")

import torch  # noqa: E402

from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.memory.allocator import SharedMemoryAllocator  # noqa: E402
from baton.memory.state import PushPhase  # noqa: E402
from baton.model import DraftSpec, MTPDraft, load_model  # noqa: E402
from baton.model.loader import save_draft  # noqa: E402
from baton.transfer.backends import backend_class, new_worker_backend  # noqa: E402
from baton.transfer.backends.base import RegionDescriptor, TransferOp  # noqa: E402
from baton.transfer.backends.loopback import LoopbackBackend  # noqa: E402
from baton.transfer.backends.shm import ShmBackend  # noqa: E402
from baton.transfer.plan import plan_ops, plan_request, total_stats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
REMOTE = ("nixl", "mooncake")
"""Backends measured across two processes (the sender is a child: ``--peer``)."""
RESULT_TAG = "result: "
PEER_TIMEOUT_S = 600.0


def make_model(directory: Path) -> None:
    """A random Qwen3 with a realistic amount of K/V per token (bf16: 16 KiB/token)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        use_sliding_window=True,
        sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"] * 4,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    target = load_model(directory)
    save_draft(directory, MTPDraft(target.spec, DraftSpec(sliding_window=128)), torch.bfloat16)


def engines(directory: Path, max_len: int, allocator):
    config = EngineConfig.from_kwargs(
        page_size=16,
        max_model_len=max_len + 64,
        max_num_seqs=2,
        kv_cache_memory_mb=max(64, 2 * max_len * 16 * 1024 // MiB),
    )
    return LLMEngine(directory, config), LLMEngine(directory, config, allocator=allocator)


def hold(engine: LLMEngine, request_id: str, num_tokens: int) -> None:
    """Give a request units for ``num_tokens`` positions in every pool, as after prefill."""
    for c in engine.registry:
        if c.push is not PushPhase.LAST:  # each component over its own handoff range
            start, end = c.handoff_range(num_tokens)
            c.owner.grow(request_id, start, end)
            c.owner.trim(request_id, end)


def state_plan(prefill: LLMEngine, decode: LLMEngine, request_id: str):
    components = {}
    for c in prefill.registry:
        if c.push is PushPhase.LAST:
            continue
        src = list(c.index(request_id).unit_ids)
        dst = list(decode.registry.get(c.name).index(request_id).unit_ids)
        components[c.name] = (src, dst, c.unit_bytes)
    return plan_request(components)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def push(backend, ops) -> None:
    transfer_id = backend.submit(ops)
    status = backend.poll(transfer_id)
    while status.is_pending:
        status = backend.poll(transfer_id)
    assert status.is_done, status
    backend.release(transfer_id)


def socket_gbps(nbytes: int, repeats: int) -> float:
    payload = memoryview(bytearray(nbytes))
    sink = bytearray(MiB)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(repeats + 1):
                left = nbytes
                while left:
                    left -= conn.recv_into(sink, min(left, MiB))
                conn.sendall(b"k")

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        client.sendall(payload)
        client.recv(1)
        if i:
            times.append(time.perf_counter() - start)
    client.close()
    server.close()
    return nbytes / statistics.median(times) / 1e9


def run(args) -> dict:
    results: dict = {"lengths": {}}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        make_model(directory)
        for length in args.lengths:
            allocator = SharedMemoryAllocator()
            try:
                results["lengths"][length] = measure(directory, length, allocator, args)
            finally:
                allocator.unlink()
    return results


def measure(directory: Path, length: int, allocator, args) -> dict:
    prefill, decode = engines(directory, length, allocator)
    rid = "bench"
    hold(prefill, rid, length)
    hold(decode, rid, length)
    for c in prefill.registry:
        c.storage.view(torch.uint8).random_(0, 255)
    plan = state_plan(prefill, decode, rid)
    stats = total_stats(plan)
    row = {
        "bytes": stats.total_bytes,
        "runs": stats.num_runs,
        "mean_run_bytes": stats.mean_run_bytes,
        "components": {k: sum(r.nbytes for r in v) for k, v in plan.items()},
    }
    src = torch.empty(stats.total_bytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    memcpy = stats.total_bytes / timed(lambda: dst.copy_(src), args.repeats) / 1e9
    row["memcpy_gbps"] = memcpy
    row["socket_gbps"] = socket_gbps(stats.total_bytes, max(2, args.repeats // 2))
    for kind in args.backends:
        if kind in REMOTE:
            row[kind] = remote_row(kind, plan_ops(plan), decode, dst, memcpy, args.repeats)
            continue
        sender = ShmBackend() if kind == "shm" else LoopbackBackend()
        receiver = ShmBackend(allocator) if kind == "shm" else LoopbackBackend()
        for c in prefill.registry:
            sender.register(c.name, c.storage)
        regions = [receiver.register(c.name, c.storage) for c in decode.registry]
        sender.register("raw_src", src)
        regions.append(receiver.register("raw_dst", dst) if kind != "shm" else None)
        sender.connect([r for r in regions if r is not None])
        ops = plan_ops(plan)
        state = stats.total_bytes / timed(lambda b=sender, o=ops: push(b, o), args.repeats) / 1e9
        for c in decode.registry:  # the bytes really landed
            if c.push is not PushPhase.LAST:
                ids = list(c.index(rid).unit_ids)
                other = prefill.registry.get(c.name)
                src_ids = list(other.index(rid).unit_ids)
                landed = c.storage[ids].view(torch.uint8)  # bytes: random bf16 holds NaNs
                assert torch.equal(landed, other.storage[src_ids].view(torch.uint8)), c.name
        raw = None
        if kind != "shm":  # raw: the same bytes, contiguous, 1 MiB runs
            ops = raw_ops(stats.total_bytes)
            seconds = timed(lambda b=sender, o=ops: push(b, o), args.repeats)
            raw = stats.total_bytes / seconds / 1e9
        else:  # raw for shm: one contiguous shared region of the same size
            raw = shm_raw_gbps(src, args.repeats)
        row[kind] = {
            "state_gbps": state,
            "raw_gbps": raw,
            "state_over_raw": state / raw,
            "state_over_memcpy": state / memcpy,
        }
        sender.close()
        receiver.close()
    return row


def raw_ops(nbytes: int) -> list[TransferOp]:
    """``nbytes`` from ``raw_src`` to ``raw_dst``, contiguous, in 1 MiB runs."""
    return [
        TransferOp("raw_src", o, "raw_dst", o, min(MiB, nbytes - o)) for o in range(0, nbytes, MiB)
    ]


def remote_row(
    kind: str,
    state_ops: list[TransferOp],
    decode: LLMEngine,
    dst: torch.Tensor,
    memcpy: float,
    repeats: int,
) -> dict:
    """State vs raw through ``kind`` from a child process (the sender) into this one."""
    try:
        receiver = backend_class(kind)()
    except (ImportError, RuntimeError, ValueError) as e:
        print(f"skipping {kind}: {e}", flush=True)
        return {"skipped": str(e)}
    try:
        descriptors = [receiver.register(c.name, c.storage) for c in decode.registry]
        descriptors.append(receiver.register("raw_dst", dst))
        phases = {"state": state_ops, "raw": raw_ops(sum(op.nbytes for op in state_ops))}
        sources: dict[str, int] = {}  # region -> bytes the sender needs (offsets start at 0)
        for op in (op for ops in phases.values() for op in ops):
            sources[op.src_region] = max(sources.get(op.src_region, 0), op.src_offset + op.nbytes)
        job = {
            "backend": kind,
            "descriptors": [d.to_dict() for d in descriptors],
            "sources": sources,
            "phases": {name: [list(op) for op in ops] for name, ops in phases.items()},
            "repeats": repeats,
        }
        result = run_peer(job)
        if result["error"]:
            print(f"{kind}: the sending peer failed: {result['error']}", flush=True)
            return {"skipped": result["error"]}
        landed = {c.name: c.storage for c in decode.registry} | {"raw_dst": dst}
        for name, ops in phases.items():  # every byte landed where the plan said
            for op in ops:
                got = landed[op.dst_region].view(-1).view(torch.uint8)
                got = got[op.dst_offset : op.dst_offset + op.nbytes]
                expected = source(op.src_region, sources[op.src_region])
                expected = expected[op.src_offset : op.src_offset + op.nbytes]
                assert torch.equal(got, expected), (kind, name, op)
    finally:
        receiver.close()
    nbytes = sum(op.nbytes for op in state_ops)
    state = nbytes / statistics.median(result["seconds"]["state"]) / 1e9
    raw = nbytes / statistics.median(result["seconds"]["raw"]) / 1e9
    return {
        "state_gbps": state,
        "raw_gbps": raw,
        "state_over_raw": state / raw,
        "state_over_memcpy": state / memcpy,
    }


_sources: dict[tuple[str, int], torch.Tensor] = {}


def source(region: str, nbytes: int) -> torch.Tensor:
    """The sender's bytes of ``region``: seeded by its name, the same in both processes."""
    key = (region, nbytes)
    if key not in _sources:
        _sources.clear()  # one at a time: the 16k-token regions are hundreds of MB
        g = torch.Generator().manual_seed(zlib.crc32(region.encode()))
        _sources[key] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return _sources[key]


def run_peer(job: dict) -> dict:
    """Run the sending side (``--peer``) in a child process; its tagged JSON result."""
    child = subprocess.run(
        [sys.executable, __file__, "--peer"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=PEER_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = [x for x in child.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if child.returncode != 0 or not lines:
        return {"error": f"exit {child.returncode}: {child.stderr[-2000:]}"}
    return json.loads(lines[-1][len(RESULT_TAG) :])


def peer() -> None:
    """The sending process: register the sources, connect, push the phases in turns."""
    job = json.loads(sys.stdin.readline())
    seconds: dict[str, list[float]] = {name: [] for name in job["phases"]}
    phases = {name: [TransferOp(*op) for op in ops] for name, ops in job["phases"].items()}
    error = ""
    # "host": the address the sender's engine advertises, where peers are other hosts
    with new_worker_backend(job["backend"], host=job.get("host")) as backend:
        tensors = {name: source(name, n) for name, n in job["sources"].items()}
        for name, tensor in tensors.items():
            backend.register(name, tensor)
        backend.connect([RegionDescriptor.from_dict(d) for d in job["descriptors"]])
        try:
            for ops in phases.values():  # warm-up: first-touch, connections, remote keys
                push(backend, ops)
            for _ in range(job["repeats"]):  # in turns, so load changes hit both alike
                for name, ops in phases.items():
                    start = time.perf_counter()
                    push(backend, ops)
                    seconds[name].append(time.perf_counter() - start)
        except AssertionError as e:  # push asserts DONE
            error = f"{job['backend']}: {e}"
    print(RESULT_TAG + json.dumps({"seconds": seconds, "error": error}), flush=True)


def shm_raw_gbps(src: torch.Tensor, repeats: int) -> float:
    allocator = SharedMemoryAllocator()
    try:
        dst = allocator.zeros("raw", tuple(src.shape), torch.uint8)
        receiver, sender = ShmBackend(allocator), ShmBackend()
        descriptor = receiver.register("raw_dst", dst)
        sender.register("raw_src", src)
        sender.connect([descriptor])
        ops = raw_ops(src.numel())
        seconds = timed(lambda: push(sender, ops), repeats)
        sender.close()
        receiver.close()
        del dst
        return src.numel() / seconds / 1e9
    finally:
        allocator.unlink()


def ttft(directory: Path, length: int) -> dict:
    """Time to first token of one request, colocated vs PD in one process over shm (PD:
    reserve -> prefill computes -> push -> decode admits; the two sides take turns)."""
    from baton.sampling_params import SamplingParams
    from baton.transfer.protocol import request_id_of
    from baton.transfer.receiver import Receiver
    from baton.transfer.sender import Sender

    prompt = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    allocator = SharedMemoryAllocator()
    try:
        colocated, decode_engine = engines(directory, length, allocator)
        for _ in range(2):  # the first run warms the engine up; the second is timed
            start = time.perf_counter()
            colocated.add_request({"prompt_token_ids": prompt.tolist()}, params)
            while not any(o.finished for o in colocated.step()):
                pass
            colocated_s = time.perf_counter() - start
        receiver = ShmBackend(allocator)
        regions = {
            c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
        }
        prefill = Sender(colocated, ShmBackend())
        prefill.connect(regions)
        decode = Receiver(decode_engine)
        start = time.perf_counter()
        decode_engine.handoff.add_for_decode(
            {"prompt_token_ids": prompt.tolist()}, params, request_id_of(1)
        )
        (reservation,) = decode_engine.handoff.reserve_queued()
        prefill.on_reserve(decode.reserve_state(1, reservation))
        replies = []
        while not replies:
            replies = prefill.step()
        decode.admit(replies[0])
        pd_s = time.perf_counter() - start
        receiver.close()
        prefill.backend.close()
    finally:
        allocator.unlink()
    return {"colocated_s": colocated_s, "pd_s": pd_s, "pd_over_colocated": pd_s / colocated_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="shm,loopback,nixl,mooncake")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ttft-lengths", default="1024,4096")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/transfer.json"))
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens, 2 repeats")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        return peer()
    if args.quick:
        args.lengths, args.repeats, args.ttft_lengths = "1024,4096", 2, ""
    args.backends = args.backends.split(",")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.ttft_lengths = [int(x) for x in args.ttft_lengths.split(",") if x]
    torch.set_num_threads(args.threads)
    results = run(args)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp))
        results["ttft"] = {n: ttft(Path(tmp), n) for n in args.ttft_lengths}
    print(
        f"{'tokens':>7} {'MB':>7} {'runs':>5} {'mean run':>9} {'memcpy':>7} {'socket':>7}  "
        f"{'backend':<9} {'state':>7} {'raw':>7} {'state/raw':>9} {'/memcpy':>8}"
    )
    for length, r in results["lengths"].items():
        mean_kib = r["mean_run_bytes"] / 1024
        head = (
            f"{length:>7} {r['bytes'] / 1e6:7.1f} {r['runs']:>5} {mean_kib:8.0f}K"
            f" {r['memcpy_gbps']:7.2f} {r['socket_gbps']:7.2f}"
        )
        for b in args.backends:
            c = r[b]
            if "skipped" in c:
                print(f"{head}  {b:<9} skipped: {c['skipped'][:80]}")
                continue
            print(
                f"{head}  {b:<9} {c['state_gbps']:7.2f} {c['raw_gbps']:7.2f}"
                f" {c['state_over_raw']:9.0%} {c['state_over_memcpy']:8.0%}"
            )
    print("GB/s; memcpy and socket (loopback TCP) move the same bytes as one buffer.")
    for length, t in results["ttft"].items():
        print(
            f"TTFT {length} tokens: colocated {t['colocated_s'] * 1e3:.0f} ms, PD (shm, one "
            f"process) {t['pd_s'] * 1e3:.0f} ms = {t['pd_over_colocated']:.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
