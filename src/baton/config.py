"""One config tree for an engine: frozen, validated dataclasses with documented defaults.

Facts discovered at start-up (pages that fit, the schema hash) go into new objects, never
back into these. ``EngineConfig.from_kwargs`` maps flat vLLM-style keyword arguments
(``LLM(model, page_size=32, max_num_seqs=8)``) onto the tree. ``Deadlines`` are the PD
workers' waits (read by ``baton.transfer``; here so a CLI can build its flags without
importing torch). Every environment variable baton reads is read here: ``RuntimeEnv``
(baton's own), ``read_secret_env`` (tokens, under names the command line chooses) and the
optional transfer engines' ``mooncake_tcp_proto`` and ``nixl_log_level``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING_MODES = ("paged", "ring")
DTYPES = ("auto", "float32", "bfloat16")
"""``EngineConfig.dtype`` values (None: the checkpoint's dtype as it is)."""

QUANTIZATIONS = ("int8", "int4")
"""``EngineConfig.quantization`` values (None: none): ``baton.model.quantize``."""
SPECULATIVE_METHODS = ("mtp", "ngram")
"""``EngineConfig.speculative_method`` values: ``baton.speculative``."""
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
"""``CacheConfig.kv_cache_dtype`` values: ``baton.memory.kv_format``."""
CPU_ISA_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16")
"""``BATON_CPU_ISA`` values, lowest first (``baton.platform`` says what each needs)."""


BUNDLED_MODEL_NAME = "baton-stdlib-qwen3"
BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / BUNDLED_MODEL_NAME
"""The model the repository ships; ``LLM("baton-stdlib-qwen3")`` and ``--model
baton-stdlib-qwen3`` find it from any directory (``resolve_model_dir``)."""


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """``model`` as a directory: the path as given, or -- when nothing is there and it is
    the bundled model's name -- the bundled model."""
    path = Path(model)
    if not path.exists() and str(model) == BUNDLED_MODEL_NAME and BUNDLED_MODEL_DIR.is_dir():
        return BUNDLED_MODEL_DIR
    return path


@dataclass(frozen=True)
class RuntimeEnv:
    """The ``BATON_*`` variables (and ``CC``) that configure baton -- read here and nowhere
    else (as are the tokens and the transfer engines' variables, by the functions below)."""

    cpu_isa: str | None = None
    """``BATON_CPU_ISA``: cap the native kernels' instruction-set level (and, below
    ``avx512``, turn native bf16 off) to run the paths of another CPU; unset: detected."""
    native_kernels: bool = True
    """``BATON_NATIVE_KERNELS=0`` chooses the torch paths instead of the C kernels."""
    native_layers: bool = True
    """``BATON_NATIVE_LAYERS=0`` keeps the C kernels but runs small steps op by op through
    torch: decoder layers (``baton.kernels.layer``) and the few-row matmuls of the head and
    the draft's projection (``baton.kernels.linear``) -- the A/B switch of both."""
    kernel_cache: str | None = None
    """``BATON_KERNEL_CACHE``: where built kernels are kept (default
    ``~/.cache/baton/kernels``)."""
    compiler: str | None = None
    """``CC``: the C compiler for the kernels (default: ``cc``, else ``gcc``)."""
    omp_threads_set: bool = False
    """``OMP_NUM_THREADS`` is set: torch's thread count is the user's (or the test's)
    choice, which an engine without ``num_threads`` keeps (``baton.cores``)."""
    debug_engine_fault_after_steps: int | None = None
    """``BATON_DEBUG_ENGINE_FAULT_AFTER_STEPS=N``, tests only: a server's engine loop raises
    after N engine steps (its requests must fail and the process must exit non-zero)."""

    def __post_init__(self) -> None:
        steps = self.debug_engine_fault_after_steps
        if steps is not None and steps < 0:
            raise ValueError(f"BATON_DEBUG_ENGINE_FAULT_AFTER_STEPS must be >= 0, got {steps}")
        if self.cpu_isa is not None and self.cpu_isa not in CPU_ISA_LEVELS:
            raise ValueError(
                f"BATON_CPU_ISA must be one of {', '.join(CPU_ISA_LEVELS)}, got {self.cpu_isa!r}"
            )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> RuntimeEnv:
        return cls(
            cpu_isa=environ.get("BATON_CPU_ISA") or None,
            native_kernels=environ.get("BATON_NATIVE_KERNELS", "1") != "0",
            native_layers=environ.get("BATON_NATIVE_LAYERS", "1") != "0",
            kernel_cache=environ.get("BATON_KERNEL_CACHE") or None,
            compiler=environ.get("CC") or None,
            omp_threads_set=bool(environ.get("OMP_NUM_THREADS")),
            debug_engine_fault_after_steps=_int_or_none(
                environ, "BATON_DEBUG_ENGINE_FAULT_AFTER_STEPS"
            ),
        )


ADMIN_TOKEN_ENV = "BATON_ADMIN_TOKEN"
SHM_DIR = "/dev/shm"
"""Where Linux exposes POSIX shared-memory segments as files (tests look for leaks here)."""
"""The router's ``/admin`` bearer token (``baton router --admin-token-env``' default; ``baton
launch`` and ``baton bench`` read it)."""


def read_secret_env(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The token in environment variable ``name``; "" when unset. Tokens travel only in the
    environment: argv is visible to every user (``ps``)."""
    return environ.get(name, "")


def mooncake_tcp_proto(environ: Mapping[str, str] = os.environ) -> str | None:
    """``MC_TCP_PROTO``, Mooncake's TCP completion mode (the mooncake backend refuses ``1``,
    which reports completion before the data lands); None when unset."""
    return environ.get("MC_TCP_PROTO")


def nixl_log_level(environ: Mapping[str, str] = os.environ) -> str | None:
    """``NIXL_LOG_LEVEL``, NIXL's own log level: when it is set (even empty) the nixl backend
    leaves NIXL's logger as NIXL sets it; None when unset."""
    return environ.get("NIXL_LOG_LEVEL")


def _int_or_none(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name) or None
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


MIN_KV_CACHE_MB = 256
"""The full-attention pool's memory at least, when sized automatically."""
AUTO_KV_TOKENS_PER_REQUEST = 512
"""Tokens per running request the automatic full-attention pool holds room for (a 6M
model's 256 MB held ~1,170 tokens of a 0.6B model in fp32: six 192-token requests)."""


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    """Tokens per page of the paged pools."""
    num_pages: int | None = None
    """Pages of the full-attention pool; None derives it from ``kv_cache_memory_mb``."""
    kv_cache_memory_mb: int | None = None
    """Memory for the full-attention pool when ``num_pages`` is None; None: enough for
    ``max_num_seqs`` requests of ``AUTO_KV_TOKENS_PER_REQUEST`` tokens, at least
    ``MIN_KV_CACHE_MB`` and at most a quarter of the memory available at start
    (``memory.cache.full_pool_pages``)."""
    kv_cache_dtype: str = "auto"
    """How the K/V pools hold rows (``memory/kv_format.py``): ``auto``, in the compute
    dtype -- bf16 where ``--dtype auto`` computes a bf16 checkpoint in fp32; ``float32``
    (an fp32 model only); ``bfloat16``, bf16 under an fp32 model (half the bytes);
    ``int8``, int8 values and an fp32 scale per position and kv head (0.52x the bytes of
    bf16 at head_dim 128: more tokens in the same memory, fewer moved by a PD handoff). The
    draft's pools too. Prefill and decode must agree (the schema says it)."""
    sliding_mode: str = "paged"
    """How sliding-window layers keep state: ``paged`` (pages behind the window are freed)
    or ``ring`` (one ring of ``window`` rows per request)."""
    enable_prefix_caching: bool = True
    """Keep complete pages cached by content and give a request sharing a prefix those
    pages instead of recomputing them (every component, target and draft; no hit in ring
    mode: ``memory/prefix_cache.py``)."""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb <= 0:
            raise ValueError(f"kv_cache_memory_mb must be positive, got {self.kv_cache_memory_mb}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.sliding_mode not in SLIDING_MODES:
            raise ValueError(
                f"sliding_mode must be one of {SLIDING_MODES}, got {self.sliding_mode!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    """Requests running at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Prompt + output limit; None means the model's ``max_position_embeddings``."""

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str | None = "auto"
    """``auto``: the checkpoint's dtype where this CPU computes it natively, else fp32 (a
    bf16 checkpoint on a CPU without native bf16: ``baton.platform``); ``float32`` or
    ``bfloat16`` as given; None keeps the checkpoint's dtype."""
    num_threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""
    small_step_threads: int | None = None
    """Threads of a small step's native calls (decode, verification: ``baton.kernels.layer``
    and ``linear``, run on ``kernels/pool.c``'s threads); None: ``num_threads``. With
    OpenMP's pool a server was faster on 1 (its HTTP side and clients share the cores and
    every region waited for a thread off its core); ``pool.c`` never waits for one, and 2
    threads serve 1.2x faster than 1 on 2 cores."""
    keep_warm_s: float = 0.0
    """A server loop (``baton serve``, a prefill worker) waiting for work keeps torch's
    second thread busy this long after its last step (a parallel no-op every 5 ms:
    ``engine/keep_warm.py``); 0 (the default): never. It costs about one core while warm;
    on the 2-core VMs here it cut the tail of a first token after 250 ms gaps (p90 16.9 ->
    6.6 ms, p50 6.4 -> 5.1)."""
    release_openmp_threads: bool = True
    """After a step that computed prompt tokens, when every running request decodes next,
    release torch's OpenMP worker threads (``baton.kernels.openmp``): they spin for
    milliseconds after a parallel region, on the core the decode steps' native calls share
    (offline, bf16 MTP: the 7 decode steps after a prompt step ran 1.56x the steady step
    time, 1.26x released; a next prompt step starts them again)."""
    quantization: str | None = None
    """Quantized weights for every matmul (``QUANTIZATIONS``: ``int8``, symmetric per output
    channel; ``int4``, symmetric per group of 32 inputs; quantized at load time, small steps
    W8A8 / W4A8: ``baton.model.quantize``); None computes with the checkpoint's weights."""
    weight_copies: int | None = None
    """Where oneDNN computes bf16 (a CPU with native bf16), how many copies of each large
    weight are held: 2, oneDNN's packed one for prompt steps and linear.c's panels for small
    steps; 1, the panels alone (half the memory; prompt steps ~0.9x); None: 2 where both fit
    in half the memory available at start, else 1 (``loader.load_fused_model``)."""
    quantize_draft: bool = True
    """With ``quantization``: the MTP draft's own matmuls (its projection and layer) are
    quantized too; False keeps them as loaded (the head is the target's, quantized)."""
    seed: int = 0
    """Seeds unseeded sampling so a whole run is reproducible."""
    speculative: bool | None = None
    """Speculative decoding; None = on when ``speculative_method`` has what it needs (an MTP
    draft: the model has one; n-grams: always)."""
    speculative_method: str = "mtp"
    """What proposes the tokens (``SPECULATIVE_METHODS``): ``mtp``, the model's MTP draft;
    ``ngram``, continuations of the request's own n-grams (``baton.speculative.ngram``: no
    draft model, for the models without an MTP head)."""
    num_speculative_tokens: int | None = None
    """Draft tokens proposed (and verified) per decode step; None: by the compute dtype
    (``engine.model_state.DRAFT_TOKENS``: 4 in bf16, 3 in fp32)."""
    debug_prefix_cache_skip_draft: bool = False
    """Debug switch: a prefix-cache hit restores the target's pages only; the draft's state
    starts empty at the hit (what a forgotten draft state costs in acceptance)."""
    debug_empty_draft_prompt_state: bool = False
    """Ablation: the draft sees none of its prompt state (as if it never arrived)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.weight_copies not in (None, 1, 2):
            raise ValueError(
                f"weight_copies must be 1, 2 or None (auto), got {self.weight_copies!r}"
            )
        if self.keep_warm_s < 0:
            raise ValueError(f"keep_warm_s must be >= 0 seconds, got {self.keep_warm_s}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.speculative_method!r}"
            )
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments -> the tree; an unknown name is a ValueError."""
        parts: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "": {}}
        owners = {
            **{f.name: "cache" for f in dataclasses.fields(CacheConfig)},
            **{f.name: "scheduler" for f in dataclasses.fields(SchedulerConfig)},
            **{f.name: "" for f in dataclasses.fields(cls) if f.name not in ("cache", "scheduler")},
        }
        for key, value in kwargs.items():
            if key not in owners:
                raise ValueError(
                    f"unknown engine option {key!r}; known: {', '.join(sorted(owners))}"
                )
            parts[owners[key]][key] = value
        return cls(
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            **parts[""],
        )


DEFAULT_LOCAL_PREFILL_TOKENS = 16
"""Measured crossover (``benchmarks/local_prefill.py``, README: 16 and 32 tokens in two runs
on an AVX2 EPYC, the bundled model): a PD decode computes prompts this short itself -- see
``LocalPrefill``."""


@dataclass(frozen=True)
class LocalPrefill:
    """When a PD decode computes a prompt itself instead of asking a prefill (conditional
    disaggregation); every such request ends as ``local_prefill`` with its reason."""

    max_prompt_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS
    """Prompts at most this long are computed here (``policy``); 0: never by length."""
    fallback: bool = True
    """Compute here when there is no prefill to ask (``no_healthy_prefill``) or the prefill
    refused the request before writing anything (``prefill_refused``); False: fail those."""

    def __post_init__(self) -> None:
        n = self.max_prompt_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"local_prefill max_prompt_tokens must be an integer >= 0, got {n!r}")


@dataclass(frozen=True)
class Deadlines:
    """Seconds each wait of a PD pair may last; both sides read the same values."""

    bootstrap_s: float = 30.0
    """Decode: Hello sent -> HelloAck received; past it ``DecodeEngine`` raises."""
    waiting_for_state_s: float = 60.0
    """ReserveState sent -> state landed. Decode fails the request past it; prefill drops a
    room older than this (its decode has given up) instead of computing and pushing it."""
    abort_grace_s: float = 30.0
    """Decode: how long a failed request's units wait for prefill to confirm it stopped
    writing before decode fails that prefill (fences it: no more requests go there, its
    waiting ones fail). The units are never freed unconfirmed: they stay quarantined until
    the prefill, or a new process at its endpoint, confirms -- or its process is seen gone
    (same host) -- since a paused prefill may resume and finish its push."""
    transferring_s: float = 60.0
    """Prefill: the longest wait for one push batch; past it its rooms fail (without
    claiming the writes stopped: the backend has no cancel) -- ``BatchRunner.transfer_s``."""
    peer_silence_s: float = 10.0
    """Decode: a prefill that owes it state and has answered nothing (not even a ``Ping``,
    sent every ``ping_interval_s``) this long is failed (fenced, as past ``abort_grace_s``):
    its requests fail now, not at ``waiting_for_state_s``, so a router can retry them
    elsewhere; their units stay quarantined until it confirms."""
    ping_interval_s: float = 1.0
    """Decode pings each prefill that owes it state this often (and resends a ``Fence``)."""
    peer_check_s: float = 2.0
    """Prefill pings its paired decodes this often: one whose connection is gone (its
    process died) is forgotten -- its rooms dropped, its regions unmapped."""
    idle_wait_s: float = 0.02
    """How long a PD loop with nothing to compute waits on its channel per turn."""

    @classmethod
    def from_args(cls, args: object) -> Deadlines:
        """From parsed ``--<field>`` flags, one per field (``cli_args`` declares them);
        ``ValueError`` names a bad one."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{f.name} must be a positive number of seconds, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{f.name} must be finite (every wait has a deadline): {value}")
