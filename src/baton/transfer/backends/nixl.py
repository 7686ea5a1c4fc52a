"""NIXL backend: prefill writes into decode's pools through NIXL's UCX engine, DRAM to DRAM.

Each side owns one NIXL agent with the UCX backend. ``register`` registers the tensor's
memory with it; the descriptor it returns names the agent and carries the agent's
serialized metadata (how to reach it, remote keys of its registrations), so the sender can
load it in ``connect`` with no side channel other than the handshake::

    address = "<agent name>#<registration count>#<base64 agent metadata>"
    offset  = the region's virtual address in the receiver's process

The metadata in a descriptor covers every region registered up to and including it; the
count orders them, so ``connect`` (re)loads a peer's metadata whenever a descriptor carries
a newer one. ``submit`` builds one NIXL WRITE per peer agent from the batch's runs and
posts it; ``poll`` asks NIXL for progress. A batch is ``DONE`` when every request is, and
``FAILED`` only once none is still in flight (quiescence). On one host UCX writes by CMA
(``process_vm_writev``) inside the post, so ``submit`` returns with the bytes landed; across
hosts the post returns at once and the copy runs on UCX's progress thread.

The ``nixl-cu12`` wheel is an optional extra, imported when a backend is built. Install it
with ``pip install --no-deps nixl-cu12``: its declared dependencies pull a CUDA torch.

Across hosts the agent needs no address of its own: its metadata lists every network
interface UCX opened, and the peer picks one it reaches. ``UCX_TLS=tcp`` on hosts without
RDMA (the namespace tests run so), ``UCX_NET_DEVICES`` to narrow the interfaces.

NOTE: ``UCX_MODULES=^ib`` must be in the environment before UCX loads, or every process
crashes at exit on machines without InfiniBand; ``import_nixl`` sets it unless the caller
already has. NIXL's UCX plugin takes no network-interface parameter (its ``device_list``
names RDMA ports such as ``mlx5_0:1``): choose interfaces with UCX's variables. Calls into
one backend must come from one thread (the agent is built without NIXL's internal locking).
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from baton.config import nixl_log_level
from baton.transfer.backends.base import (
    DONE,
    RegionDescriptor,
    Status,
    TransferBackend,
    TransferOp,
    failed,
)

INSTALL_HINT = (
    "the nixl backend needs `pip install --no-deps nixl-cu12` (with its dependencies it "
    "pulls a multi-GB CUDA torch)"
)
CLOSE_TIMEOUT_S = 10.0
"""How long ``close`` waits for in-flight requests before aborting them."""
PROGRESS_DELAY_US = 100
"""How long NIXL's progress thread sleeps between rounds. NOTE: NIXL's Python API hard-codes
0, a thread spinning one core flat out, which starves torch's threads in the same process:
over UCX TCP a 300-token PD request took ~450 ms to its first token against ~75 ms with this
delay (and with shm or Mooncake), the prefill's steps being ~8x slower (measured, AVX2 EPYC,
2 cores)."""


def import_nixl() -> ModuleType:
    """The installed NIXL Python API; ``ImportError`` with the install line if none is."""
    # NOTE: without this UCX's InfiniBand module segfaults every process at exit here.
    os.environ.setdefault("UCX_MODULES", "^ib")
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            # NOTE: NIXL logs every agent start at INFO on stdout; keep only warnings unless
            # the user asked for more with NIXL_LOG_LEVEL.
            if nixl_log_level() is None:
                logging.getLogger("nixl").setLevel(logging.WARNING)
            return module
    raise ImportError(INSTALL_HINT)


def _new_agent(nixl: ModuleType, name: str) -> Any:
    """A NIXL agent (UCX created by the caller) whose progress thread sleeps
    ``PROGRESS_DELAY_US`` between rounds: the API offers no such option, so the one config
    field it pins to 0 is raised while the agent is built (a NIXL without that layout gets
    its default agent)."""
    bind = getattr(importlib.import_module(f"{nixl.__name__}._api"), "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    field = getattr(base, "pthrDelay", None)
    if field is None:
        return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=[]))

    class DelayedConfig(base):
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            field.__set__(self, max(value, PROGRESS_DELAY_US))

    bind.nixlAgentConfig = DelayedConfig
    try:
        return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=[]))
    finally:
        bind.nixlAgentConfig = base


@dataclass
class _Inflight:
    handles: list[Any] = field(default_factory=list)
    """NIXL transfer handles (one per peer agent), posted and not yet released."""
    reason: str = ""
    """Why the batch failed (set when posting one of its requests failed)."""


class NixlBackend(TransferBackend):
    kind = "nixl"

    @classmethod
    def require_engine(cls) -> None:
        import_nixl()

    def __init__(self, agent_name: str = "") -> None:
        """``agent_name``: unique among the peers (default: pid + random suffix)."""
        super().__init__()
        if "#" in agent_name:
            raise ValueError(f"nixl: agent name {agent_name!r} must not contain '#'")
        nixl = import_nixl()
        self.agent_name = agent_name or f"baton-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent = _new_agent(nixl, self.agent_name)
        self._agent.create_backend("UCX", {})
        self._registrations: list[Any] = []
        """NIXL registration lists, deregistered by ``close``."""
        self._peers: dict[str, int] = {}
        """Peer agent name -> registration count of the metadata loaded for it."""
        self._peer_regions: dict[str, tuple[str, int]] = {}
        """Peer region name -> (its agent, its virtual address)."""
        self._inflight: dict[int, _Inflight] = {}

    # -- set-up ----------------------------------------------------------------------------
    def _describe(self, name: str, tensor: torch.Tensor, flat: torch.Tensor) -> RegionDescriptor:
        if flat.device.type != "cpu":
            raise ValueError(f"nixl: region {name!r} is on {flat.device}; only DRAM is supported")
        address = flat.data_ptr()
        registration = self._agent.register_memory(
            [(address, flat.numel(), 0, name)], "DRAM", backends=["UCX"]
        )
        self._registrations.append(registration)
        metadata = base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")
        where = f"{self.agent_name}#{len(self._registrations)}#{metadata}"
        return RegionDescriptor(self.kind, name, flat.numel(), where, offset=address)

    def _reach(self, descriptor: RegionDescriptor) -> torch.Tensor:
        agent, count, metadata = _parse_address(descriptor)
        if count > self._peers.get(agent, 0):  # newer metadata: it covers more regions
            loaded = self._agent.add_remote_agent(base64.b64decode(metadata))
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != agent:
                raise ValueError(
                    f"nixl: peer region {descriptor.region!r} names agent {agent!r} but its "
                    f"metadata is agent {loaded!r}"
                )
            self._peers[agent] = count
        self._peer_regions[descriptor.region] = (agent, descriptor.offset)
        # Peer memory is not mapped here: a meta tensor carries only the size for bounds checks.
        return torch.empty(descriptor.nbytes, dtype=torch.uint8, device="meta")

    # -- transfers -------------------------------------------------------------------------
    def _start(self, transfer_id: int, batch: Sequence[TransferOp]) -> None:
        inflight = self._inflight[transfer_id] = _Inflight()
        by_agent: dict[str, list[TransferOp]] = {}
        for op in batch:
            by_agent.setdefault(self._peer_regions[op.dst_region][0], []).append(op)
        for agent, ops in by_agent.items():
            try:
                local, remote = self._descs(ops)
                handle = self._agent.initialize_xfer("WRITE", local, remote, agent)
                inflight.handles.append(handle)
                if self._agent.transfer(handle) == "ERR":
                    inflight.reason = f"nixl: posting the write to agent {agent!r} failed"
            except Exception as e:  # a failed transfer is a state (base contract)
                inflight.reason = f"nixl: write to agent {agent!r} failed: {type(e).__name__}: {e}"
            if inflight.reason:
                break  # requests already posted still finish before FAILED is reported
        self._progress(transfer_id)

    def _descs(self, ops: Sequence[TransferOp]) -> tuple[Any, Any]:
        """NIXL descriptor lists of the runs: rows of (address, nbytes, device 0)."""
        src_base = {name: flat.data_ptr() for name, flat in self._local.items()}
        dst_base = {name: address for name, (_, address) in self._peer_regions.items()}
        runs = np.array(  # [num_ops, 3]: source address, destination address, nbytes
            [
                (
                    src_base[op.src_region] + op.src_offset,
                    dst_base[op.dst_region] + op.dst_offset,
                    op.nbytes,
                )
                for op in ops
            ],
            dtype=np.uint64,
        )
        local = np.zeros((len(ops), 3), dtype=np.uint64)  # [num_ops, 3]: address, nbytes, 0
        remote = np.zeros((len(ops), 3), dtype=np.uint64)
        local[:, 0], remote[:, 0] = runs[:, 0], runs[:, 1]
        local[:, 1] = remote[:, 1] = runs[:, 2]
        return (
            self._agent.get_xfer_descs(local, "DRAM"),
            self._agent.get_xfer_descs(remote, "DRAM"),
        )

    def poll(self, transfer_id: int) -> Status:
        if transfer_id in self._inflight:
            self._progress(transfer_id)
        return super().poll(transfer_id)

    def _progress(self, transfer_id: int) -> None:
        """Ask NIXL about a batch's requests; finish the batch once none is in flight."""
        inflight = self._inflight[transfer_id]
        states = []
        for handle in inflight.handles:
            try:
                states.append(self._agent.check_xfer_state(handle))
            except Exception as e:
                states.append(f"ERR ({type(e).__name__}: {e})")
        if "PROC" in states:
            return
        del self._inflight[transfer_id]
        for handle in inflight.handles:
            _release(handle)
        errors = [s for s in states if s != "DONE"]
        if errors and not inflight.reason:
            inflight.reason = f"nixl: {len(errors)} of {len(states)} writes ended in {errors[0]}"
        self._finish(transfer_id, failed(inflight.reason) if inflight.reason else DONE)

    def _shutdown(self) -> None:
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self._inflight and time.monotonic() < deadline:
            for transfer_id in list(self._inflight):
                self._progress(transfer_id)
            time.sleep(0.001)
        for transfer_id, inflight in list(self._inflight.items()):
            for handle in inflight.handles:  # releasing an active request aborts it
                _release(handle)
            self._finish(transfer_id, failed("nixl: backend closed with the transfer in flight"))
        self._inflight.clear()
        for agent in self._peers:
            _quietly(self._agent.remove_remote_agent, agent)
        for registration in self._registrations:
            _quietly(self._agent.deregister_memory, registration)
        self._peers.clear()
        self._peer_regions.clear()
        self._registrations.clear()
        self._agent = None  # the agent's destructor stops UCX's threads


def _parse_address(descriptor: RegionDescriptor) -> tuple[str, int, str]:
    agent, _, rest = descriptor.address.partition("#")
    count, _, metadata = rest.partition("#")
    if not agent or not count.isdigit() or not metadata:
        raise ValueError(
            f"nixl: peer region {descriptor.region!r} has no agent metadata in its address "
            f"{descriptor.address[:40]!r}"
        )
    return agent, int(count), metadata


def _release(handle: Any) -> None:
    _quietly(handle.release)


def _quietly(call: Any, *args: Any) -> None:
    """Clean-up calls: a failure to free an engine object must not mask the state."""
    with contextlib.suppress(Exception):
        call(*args)
