"""Grammar engines for structured outputs on CPU: llguidance against xgrammar, measured.

Both engines turn a JSON schema into a per-step token mask (a packed int32 bitmask over the
bundled model's 4,096-token vocabulary, eos ids 0 and 2). For each backend that imports (only
llguidance is a declared dependency; a missing one is skipped with the reason printed):

- setup: the import in a fresh interpreter (``llguidance.torch`` apart: it applies
  ``torch.compile`` at import, which loads torch._dynamo), the tokenizer build
  (``LLTokenizer``; the transformers tokenizer plus ``TokenizerInfo`` for xgrammar), each
  schema's cold compile, matcher and first mask (first in the process), the same uncached, and
  what a new request with a schema seen before costs (llguidance: ``LLMatcher`` from the
  grammar string, or ``deep_copy`` of a kept matcher; xgrammar: the compiler's cache hit plus
  ``GrammarMatcher``, or ``GrammarMatcher`` from a kept ``CompiledGrammar``);
- batch 1: a valid instance of each schema, tokenized by the model's tokenizer and followed by
  eos, walked token by token; only the mask computation is timed per step (mean, p50, p99 in
  microseconds), the token's consumption separately; for llguidance both through
  ``llguidance.torch.fill_next_token_bitmask`` and through ``unsafe_compute_mask_ptr`` (the
  same work without the wrapper's per-call torch indexing). Where a backend rejects that
  tokenization the document is generated instead, by sampling uniformly from the allowed mask
  with a fixed seed (eos as soon as it is allowed), at most 200 tokens;
- batch 32: 32 matchers over mixed schemas and distinct instances advanced in lockstep, the
  whole batch's masks timed per step and per token: sequentially per matcher, and with the
  batch API on 1 and ``--threads`` threads (llguidance ``fill_next_token_bitmask_par`` on an
  ``LLExecutor``; xgrammar ``BatchGrammarMatcher.batch_fill_next_token_bitmask``);
- rollback(n) per call for n = 1 and 4 (speculative decoding rolls back rejected drafts);
- applying a [32, 4096] bitmask to fp32 logits: plain torch (unpack the bits, then
  ``masked_fill_``), llguidance's ``apply_token_bitmask_inplace`` (torch.compile: its first
  call is reported apart) and xgrammar's CPU kernel and its torch-native path;
- a conformance check: a document breaking each schema (enum, maximum, minimum) must be refused.

JSON is compact (no whitespace) for both engines unless ``--whitespace flexible``. The CPU,
torch threads, backend versions and the load average (the machine may be shared: it shows in
means and p99s; p50s hold up better) are printed first.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grammar_backends.py [--reps 5]
        [--batch 32] [--whitespace compact|flexible] [--no-torch-compile] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import machine_facts  # noqa: E402

from baton import platform  # noqa: E402

TOKENIZER = REPO / "models" / "baton-stdlib-qwen3" / "tokenizer.json"
VOCAB = 4096
EOS_IDS = [0, 2]
EOS = 0
MAX_SAMPLED_TOKENS = 200
ROLLBACK_NS = (1, 4)

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "active": {"type": "boolean"},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "active", "role"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name", "email"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 100},
                        "price": {"type": "number", "minimum": 0, "maximum": 10000},
                    },
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
            },
            "total": {"type": "number", "minimum": 0},
        },
        "required": ["order_id", "customer", "items", "total"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "tags": {"type": "array", "items": {"type": "string"}},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
            "draft": {"type": "boolean"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}

WORDS = [
    "Ada",
    "Grace Hopper",
    "Alan",
    "Edsger",
    "Barbara Liskov",
    "Ken",
    "Donald Knuth",
    "Niklaus",
]


def instance(schema: str, i: int) -> dict:
    """The ``i``-th valid instance of ``schema`` (values and optional fields vary with ``i``)."""
    word = WORDS[i % len(WORDS)]
    if schema == "flat":
        role = ["admin", "user", "guest"][i % 3]
        return {"name": word, "age": 20 + 7 * i, "active": i % 2 == 0, "role": role}
    if schema == "nested":
        items = [
            {"sku": f"SKU-{100 + 13 * i + k}", "qty": 1 + (i + k) % 9, "price": 2.5 + 10 * k}
            for k in range(1 + i % 3)
        ]
        total = round(sum(it["qty"] * it["price"] for it in items), 2)
        email = f"{word.split()[0].lower()}@example.com"
        customer = {"name": word, "email": email}
        return {"order_id": 1000 + i, "customer": customer, "items": items, "total": total}
    doc: dict = {"title": f"On {word}"}
    if i % 2 == 0:
        doc["year"] = 1950 + i
    if i % 3 != 2:
        doc["tags"] = ["history", "computing"][: 1 + i % 2]
    if i % 4 == 1:
        doc["rating"] = 4.5
    if i % 5 == 0:
        doc["draft"] = False
    return doc


INVALID = {
    "flat": {"name": "Ada", "age": 36, "active": True, "role": "root"},  # not in the enum
    "nested": {
        "order_id": 7,
        "customer": {"name": "Ada", "email": "a@b.c"},
        "items": [{"sku": "X", "qty": 101, "price": 1.5}],  # qty above maximum
        "total": 151.5,
    },
    "optional": {"title": "Old", "year": 1800},  # year below minimum
}
INVALID_WHY = {"flat": "enum", "nested": "maximum", "optional": "minimum"}


def dump(doc: dict, whitespace: str) -> str:
    return json.dumps(doc) if whitespace == "flexible" else json.dumps(doc, separators=(",", ":"))


def tokenize(text: str) -> list[int]:
    from tokenizers import Tokenizer

    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer.from_file(str(TOKENIZER))
    return _TOKENIZER.encode(text, add_special_tokens=False).ids


_TOKENIZER = None


def unpack(bitmask: torch.Tensor) -> torch.Tensor:
    """[B, W] int32 bitmask -> [B, VOCAB] bool (allowed)."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).bool().view(bitmask.shape[0], -1)[:, :VOCAB]


def stats_us(ns: list[int]) -> dict:
    """Mean, p50, p99 (microseconds) of ``ns`` nanosecond samples."""
    us = sorted(x / 1e3 for x in ns)
    p99 = us[min(len(us) - 1, round(0.99 * (len(us) - 1)))]
    return {"mean": statistics.fmean(us), "p50": statistics.median(us), "p99": p99, "n": len(us)}


# -- backends ----------------------------------------------------------------------------------
class LLGuidance:
    name = "llguidance"

    modules = ("llguidance", "llguidance.torch")
    """Imported one by one: ``llguidance.torch`` applies ``torch.compile`` at import."""

    def __init__(self, whitespace: str, threads: int):
        self.llg = importlib.import_module("llguidance")
        self.llt = importlib.import_module("llguidance.torch")
        self.version = importlib.metadata.version("llguidance")
        self.options = {"whitespace_flexible": whitespace == "flexible"}
        self.executors: dict[int, object] = {}

    def build_tokenizer(self) -> dict:
        t0 = time.perf_counter()
        text = TOKENIZER.read_text()
        self.tok = self.llg.LLTokenizer(text, n_vocab=VOCAB, eos_token=EOS_IDS)
        return {"tokenizer_s": time.perf_counter() - t0}

    def compile(self, schema: dict, cache: bool = True) -> str:
        """The schema as a grammar string; ``LLMatcher`` builds the parser (the real compile)."""
        return self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)

    def matcher(self, compiled: str):
        matcher = self.llg.LLMatcher(self.tok, compiled, log_level=0)  # errors: is_error
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def request_setups(self, schema: dict, compiled: str) -> dict:
        """Ways to start a request with a schema seen before: llguidance caches no compiled
        grammar, so an ``LLMatcher`` from the grammar string, or a ``deep_copy`` of a matcher
        kept per schema (its lexer already built by one mask)."""
        pristine = self.matcher(compiled)
        self.fill(pristine, bitmask(1), 0)
        return {
            "LLMatcher(grammar)": lambda: self.matcher(compiled),
            "deep_copy(cached matcher)": pristine.deep_copy,
        }

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_ptr(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        """The wrapper's work without its per-call torch indexing and asserts."""
        row_bytes = bitmask.shape[1] * 4
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    def fills(self) -> dict:
        return {"fill_next_token_bitmask": self.fill, "unsafe_compute_mask_ptr": self.fill_ptr}

    def fill_batch(self, matchers: list, rows: list[int], bitmask: torch.Tensor, threads: int):
        if threads not in self.executors:
            self.executors[threads] = self.llg.LLExecutor(num_threads=threads)
        pairs = list(zip(matchers, rows, strict=True))
        self.llt.fill_next_token_bitmask_par(self.executors[threads], pairs, bitmask)

    batch_api = "fill_next_token_bitmask_par(LLExecutor)"

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher, n: int) -> None:
        if not matcher.rollback(n):
            raise RuntimeError(f"llguidance rollback({n}) failed: {matcher.get_error()}")

    def reset(self, matcher) -> None:
        matcher.reset()

    def done(self, matcher) -> bool:
        return matcher.is_stopped()

    def applies(self) -> dict:
        return {"llguidance apply_token_bitmask_inplace (torch.compile)": self._apply}

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)


class XGrammar:
    name = "xgrammar"

    modules = ("xgrammar",)

    def __init__(self, whitespace: str, threads: int):
        self.xgr = importlib.import_module("xgrammar")
        self.compile_threads = threads
        self.version = importlib.metadata.version("xgrammar")
        if whitespace == "flexible":
            self.options = {"any_whitespace": True}
        else:
            self.options = {"any_whitespace": False, "separators": (",", ":")}
        self.batchers: dict[int, object] = {}

    def build_tokenizer(self) -> dict:
        import transformers

        t0 = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))
        t1 = time.perf_counter()
        info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=EOS_IDS)
        t2 = time.perf_counter()
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=self.compile_threads)
        self.fresh = self.xgr.GrammarCompiler(
            info, max_threads=self.compile_threads, cache_enabled=False
        )
        t3 = time.perf_counter()
        return {
            "tokenizer_s": t3 - t0,
            "hf_tokenizer_s": t1 - t0,
            "tokenizer_info_s": t2 - t1,
            "compiler_s": t3 - t2,
            "vocab_type": str(info.vocab_type),
        }

    def compile(self, schema: dict, cache: bool = True):
        compiler = self.compiler if cache else self.fresh
        return compiler.compile_json_schema(schema, **self.options)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def request_setups(self, schema: dict, compiled) -> dict:
        """Ways to start a request with a schema seen before: the compiler's cache hit plus a
        ``GrammarMatcher``, or a matcher from a ``CompiledGrammar`` kept by the caller."""
        return {
            "compile (cache hit) + GrammarMatcher": lambda: self.matcher(
                self.compiler.compile_json_schema(schema, **self.options)
            ),
            "GrammarMatcher(compiled)": lambda: self.matcher(compiled),
        }

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fills(self) -> dict:
        return {"fill_next_token_bitmask": self.fill}

    def fill_batch(self, matchers: list, rows: list[int], bitmask: torch.Tensor, threads: int):
        if threads not in self.batchers:
            self.batchers[threads] = self.xgr.BatchGrammarMatcher(max_threads=threads)
        self.batchers[threads].batch_fill_next_token_bitmask(matchers, bitmask, rows)

    batch_api = "BatchGrammarMatcher.batch_fill_next_token_bitmask"

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def reset(self, matcher) -> None:
        matcher.reset()

    def done(self, matcher) -> bool:
        return matcher.is_terminated()

    def applies(self) -> dict:
        return {
            "xgrammar apply_token_bitmask_inplace (cpu kernel)": self._apply_cpu,
            "xgrammar apply_token_bitmask_inplace (torch_native)": self._apply_native,
        }

    def _apply_cpu(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB, backend="cpu")

    def _apply_native(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=VOCAB, backend="torch_native"
        )


BACKENDS = {"llguidance": LLGuidance, "xgrammar": XGrammar}


# -- measurements ------------------------------------------------------------------------------
def bitmask(rows: int) -> torch.Tensor:
    return torch.full((rows, (VOCAB + 31) // 32), -1, dtype=torch.int32)


def accepts(backend, compiled, tokens: list[int]) -> bool:
    """Whether ``tokens`` (ending in eos) are accepted one by one and the matcher ends."""
    matcher = backend.matcher(compiled)
    return all(backend.consume(matcher, t) for t in tokens) and backend.done(matcher)


def sampled_document(backend, compiled, seed: int) -> list[int]:
    """A document the backend accepts: uniform over the allowed mask, eos once allowed."""
    rng = random.Random(seed)
    matcher, mask = backend.matcher(compiled), bitmask(1)
    tokens: list[int] = []
    while len(tokens) < MAX_SAMPLED_TOKENS and not backend.done(matcher):
        backend.fill(matcher, mask, 0)
        allowed = unpack(mask)[0].nonzero().view(-1).tolist()
        if not allowed:
            break
        token = EOS if EOS in allowed else rng.choice(allowed)
        if not backend.consume(matcher, token):
            raise RuntimeError(f"{backend.name} refused token {token} from its own mask")
        tokens.append(token)
    return tokens


def documents(backend, compiled: dict, whitespace: str, count: int) -> tuple[dict, dict]:
    """``count`` token sequences per schema (each ending in eos) and how they were made."""
    docs, origin = {}, {}
    for schema, grammar in compiled.items():
        seqs = [tokenize(dump(instance(schema, i), whitespace)) + [EOS] for i in range(count)]
        if all(accepts(backend, grammar, s) for s in seqs):
            docs[schema], origin[schema] = seqs, "tokenized instance"
        else:
            docs[schema] = [sampled_document(backend, grammar, seed=i) for i in range(count)]
            origin[schema] = "sampled (tokenized instance refused)"
    return docs, origin


def import_seconds(modules: tuple[str, ...]) -> dict[str, float | None]:
    """Seconds to import each of ``modules`` (in order, each including the ones before it
    left to do) in a fresh interpreter that has torch imported already."""
    code = "import time, torch\n" + "".join(
        f"t = time.perf_counter()\nimport {m}\nprint(time.perf_counter() - t)\n" for m in modules
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        times = [float(x) for x in run.stdout.split()]
    except ValueError:
        times = []
    return {m: times[i] if i < len(times) else None for i, m in enumerate(modules)}


def start(backend, spec: dict, cache: bool) -> tuple:
    """Compile ``spec``, make a matcher, compute its first mask: (compiled, ms, ms, us)."""
    t0 = time.perf_counter()
    compiled = backend.compile(spec, cache=cache)
    t1 = time.perf_counter()
    matcher = backend.matcher(compiled)
    t2 = time.perf_counter()
    backend.fill(matcher, bitmask(1), 0)
    t3 = time.perf_counter()
    return compiled, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e6


def measure_setup(backend, reps: int) -> tuple[dict, dict]:
    out = {"import_s": import_seconds(backend.modules), **backend.build_tokenizer()}
    compiled, per_schema = {}, {}
    for schema, spec in SCHEMAS.items():
        compiled[schema], compile_ms, matcher_ms, mask_us = start(backend, spec, cache=True)
        nocache = [start(backend, spec, cache=False) for _ in range(reps)]
        r = {
            "cold_compile_ms": compile_ms,
            "cold_matcher_ms": matcher_ms,
            "cold_first_mask_us": mask_us,
            "cold_total_ms": compile_ms + matcher_ms + mask_us / 1e3,
            "nocache_total_ms": statistics.median(a + b + c / 1e3 for _, a, b, c in nocache),
            "new_request_us": {},
        }
        for way, make in backend.request_setups(spec, compiled[schema]).items():
            samples = []
            for _ in range(max(reps, 5)):
                t0 = time.perf_counter()
                matcher = make()
                t1 = time.perf_counter()
                backend.fill(matcher, bitmask(1), 0)
                samples.append(((t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6))
            r["new_request_us"][way] = {
                "setup": statistics.median(a for a, _ in samples),
                "first_mask": statistics.median(b for _, b in samples),
            }
        per_schema[schema] = r
    out["schemas"] = per_schema
    return out, compiled


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def walk(backend, fill, matcher, tokens: list[int], mask: torch.Tensor, check: bool) -> tuple:
    """Mask then consume each token; the per-step mask and consume times (ns)."""
    fill_ns, consume_ns = [], []
    clock = time.perf_counter_ns
    for token in tokens:
        t0 = clock()
        fill(matcher, mask, 0)
        t1 = clock()
        ok = backend.consume(matcher, token)
        t2 = clock()
        if check and not (ok and allowed(mask, 0, token)):
            raise RuntimeError(f"{backend.name}: token {token} not allowed by its mask")
        fill_ns.append(t1 - t0)
        consume_ns.append(t2 - t1)
    return fill_ns, consume_ns


def measure_batch1(backend, compiled: dict, docs: dict, reps: int) -> dict:
    """Per fill call (the backend's ways to compute a mask), per schema and over all."""
    out = {}
    mask = bitmask(1)
    for label, fill in backend.fills().items():
        r, all_fill, all_consume = {}, [], []
        for schema, grammar in compiled.items():
            tokens = docs[schema][0]
            matcher = backend.matcher(grammar)
            walk(backend, fill, matcher, tokens, mask, check=True)  # warm-up, checks masks
            fills, consumes = [], []
            for _ in range(reps):
                backend.reset(matcher)
                f, c = walk(backend, fill, matcher, tokens, mask, check=False)
                fills += f
                consumes += c
            r[schema] = {"tokens": len(tokens), "mask_us": stats_us(fills)}
            r[schema]["consume_us"] = stats_us(consumes)
            all_fill += fills
            all_consume += consumes
        r["all"] = {"mask_us": stats_us(all_fill), "consume_us": stats_us(all_consume)}
        out[label] = r
    return out


def batch_run(backend, matchers, seqs, mask, fill_all) -> tuple[list[int], int]:
    """One lockstep pass of all matchers over their sequences: per-step mask times (ns)."""
    pos = [0] * len(matchers)
    steps, masks = [], 0
    clock = time.perf_counter_ns
    while True:
        rows = [i for i, seq in enumerate(seqs) if pos[i] < len(seq)]
        if not rows:
            return steps, masks
        active = [matchers[i] for i in rows]
        t0 = clock()
        fill_all(active, rows, mask)
        steps.append(clock() - t0)
        masks += len(rows)
        for i, matcher in zip(rows, active, strict=True):
            if not backend.consume(matcher, seqs[i][pos[i]]):
                raise RuntimeError(f"{backend.name}: row {i} refused its token at {pos[i]}")
            if pos[i] == 0 and not allowed(mask, i, seqs[i][0]):
                raise RuntimeError(f"{backend.name}: row {i}'s first token not in its mask")
            pos[i] += 1


def sequential(fill):
    def fill_all(matchers: list, rows: list[int], mask: torch.Tensor) -> None:
        for i, matcher in zip(rows, matchers, strict=True):
            fill(matcher, mask, i)

    return fill_all


def batched(backend, threads: int):
    def fill_all(matchers: list, rows: list[int], mask: torch.Tensor) -> None:
        backend.fill_batch(matchers, rows, mask, threads)

    return fill_all


def measure_batch(backend, compiled: dict, docs: dict, batch: int, reps: int, threads: int):
    names = list(compiled)
    schemas = [names[i % len(names)] for i in range(batch)]
    seqs = [docs[s][i // len(names)] for i, s in enumerate(schemas)]
    matchers = [backend.matcher(compiled[s]) for s in schemas]
    mask = bitmask(batch)
    modes = {f"sequential {label}": sequential(fill) for label, fill in backend.fills().items()}
    for n in sorted({1, threads}):
        modes[f"{backend.batch_api}, {n} thread{'s' if n > 1 else ''}"] = batched(backend, n)
    out = {"schemas": {s: schemas.count(s) for s in names}, "modes": {}}
    for mode, fill_all in modes.items():
        for m in matchers:
            backend.reset(m)
        batch_run(backend, matchers, seqs, mask, fill_all)  # warm-up
        steps, masks = [], 0
        for _ in range(reps):
            for m in matchers:
                backend.reset(m)
            s, n = batch_run(backend, matchers, seqs, mask, fill_all)
            steps += s
            masks += n
        out["modes"][mode] = {
            "step_us": stats_us(steps),
            "per_token_us": sum(steps) / masks / 1e3,
            "steps": len(steps) // reps,
            "masks_per_pass": masks // reps,
        }
    return out


def measure_rollback(backend, compiled: dict, docs: dict, reps: int) -> dict:
    tokens = docs["nested"][0]
    matcher = backend.matcher(compiled["nested"])
    mid = len(tokens) // 2
    for token in tokens[:mid]:
        backend.consume(matcher, token)
    out, clock, mask = {}, time.perf_counter_ns, bitmask(1)
    for n in ROLLBACK_NS:
        samples = []
        for _ in range(max(50, 20 * reps)):
            for token in tokens[mid : mid + n]:
                if not backend.consume(matcher, token):
                    raise RuntimeError(f"{backend.name}: refused token before rollback")
            t0 = clock()
            backend.rollback(matcher, n)
            samples.append(clock() - t0)
        backend.fill(matcher, mask, 0)  # the state is the one before: its next token allowed
        if not allowed(mask, 0, tokens[mid]):
            raise RuntimeError(f"{backend.name}: wrong mask after rollback({n})")
        out[f"rollback_{n}_us"] = stats_us(samples)
    return out


def inductor_cache_warm() -> bool:
    """Whether torch inductor's on-disk cache has entries (a warm cache shortens the first
    ``torch.compile`` call by most of its time)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        path = Path(cache_dir())
    except Exception:  # noqa: BLE001 -- a private module: guess the default
        path = Path("/tmp") / f"torchinductor_{os.environ.get('USER', 'root')}"
    return path.is_dir() and any(path.iterdir())


def time_apply(fn, logits: torch.Tensor, mask: torch.Tensor, reps: int) -> dict:
    work = logits.clone()
    t0 = time.perf_counter()
    fn(work, mask)
    first = time.perf_counter() - t0
    samples = []
    for _ in range(max(50, 20 * reps)):
        work.copy_(logits)
        t0 = time.perf_counter_ns()
        fn(work, mask)
        samples.append(time.perf_counter_ns() - t0)
    expected = logits.masked_fill(~unpack(mask), float("-inf"))
    return {"first_call_ms": first * 1e3, "us": stats_us(samples), "correct": work.equal(expected)}


def measure_apply(backends: list, compiled_masks: torch.Tensor, reps: int, compile_ok: bool):
    batch = compiled_masks.shape[0]
    torch.manual_seed(0)
    logits = torch.randn(batch, VOCAB)
    bits = torch.arange(32, dtype=torch.int32)

    def plain(work: torch.Tensor, mask: torch.Tensor) -> None:
        allowed = ((mask[:, :, None] >> bits) & 1).bool().view(batch, -1)[:, :VOCAB]
        work.masked_fill_(~allowed, float("-inf"))

    fns = {"torch: unpack bits + masked_fill_": plain}
    for backend in backends:
        fns.update(backend.applies())
    out = {}
    warm = inductor_cache_warm()
    for name, fn in fns.items():
        if "torch.compile" in name and not compile_ok:
            out[name] = {"error": "skipped (--no-torch-compile)"}
            continue
        try:
            out[name] = time_apply(fn, logits, compiled_masks, reps)
            if "torch.compile" in name:
                out[name]["inductor_cache_warm_before"] = warm
        except Exception as e:  # noqa: BLE001 -- report what failed, go on
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return out


def measure_conformance(backend, compiled: dict, whitespace: str) -> dict:
    out = {}
    for schema, doc in INVALID.items():
        tokens = tokenize(dump(doc, whitespace)) + [EOS]
        out[schema] = {"violates": INVALID_WHY[schema]}
        out[schema]["refused"] = not accepts(backend, compiled[schema], tokens)
    return out


# -- report ------------------------------------------------------------------------------------
def cpu_header() -> dict:
    fields = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU family", "Model"):
                fields[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "model_name": fields.get("Model name", platform.current().cpu_name),
        "family": fields.get("CPU family", "?"),
        "model": fields.get("Model", "?"),
        "avx2": "avx2" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "cpus": len(os.sched_getaffinity(0)),
    }


def fmt_stats(s: dict) -> str:
    return f"{s['mean']:8.1f} {s['p50']:8.1f} {s['p99']:8.1f}"


def report(results: dict) -> None:
    names = list(results["backends"])
    print("\n== setup ==")
    for name in names:
        r = results["backends"][name]["setup"]
        imported = ", ".join(
            f"{m} {'?' if t is None else f'{t * 1e3:.0f} ms'}" for m, t in r["import_s"].items()
        )
        extra = ""
        if "tokenizer_info_s" in r:
            extra = (
                f" (transformers tokenizer {r['hf_tokenizer_s'] * 1e3:.1f} ms + TokenizerInfo"
                f" {r['tokenizer_info_s'] * 1e3:.1f} ms + compilers {r['compiler_s'] * 1e3:.2f} ms)"
            )
        print(
            f"{name:<11} import {imported} (fresh interpreter, torch already imported); "
            f"tokenizer {r['tokenizer_s'] * 1e3:.1f} ms{extra}"
        )
    print(
        "cold = first in the process: compile (JSON schema -> grammar), matcher, first mask;"
        " no-cache = all three again, uncached (median)"
    )
    print(
        f"{'backend':<11} {'schema':<9} {'compile ms':>10} {'matcher ms':>10} "
        f"{'1st mask us':>11} {'cold ms':>8} {'no-cache ms':>11}"
    )
    for name in names:
        for schema, s in results["backends"][name]["setup"]["schemas"].items():
            print(
                f"{name:<11} {schema:<9} {s['cold_compile_ms']:10.2f} {s['cold_matcher_ms']:10.2f}"
                f" {s['cold_first_mask_us']:11.1f} {s['cold_total_ms']:8.2f}"
                f" {s['nocache_total_ms']:11.2f}"
            )
    print("a new request with a schema seen before: setup us + first mask us (median)")
    for name in names:
        for schema, s in results["backends"][name]["setup"]["schemas"].items():
            line = "; ".join(
                f"{way} {v['setup']:.1f} + {v['first_mask']:.1f}"
                for way, v in s["new_request_us"].items()
            )
            print(f"{name:<11} {schema:<9} {line}")

    print("\n== batch 1: mask per token, us (mean p50 p99); consume per token, us (mean p50) ==")
    print(
        f"{'backend':<11} {'mask call':<24} {'schema':<9} {'tokens':>6} {'mean':>8} {'p50':>8}"
        f" {'p99':>8}  consume"
    )
    for name in names:
        for label, r in results["backends"][name]["batch1"].items():
            for schema, s in r.items():
                c = s["consume_us"]
                print(
                    f"{name:<11} {label:<24} {schema:<9} {s.get('tokens', '')!s:>6} "
                    f"{fmt_stats(s['mask_us'])}  {c['mean']:6.1f} {c['p50']:6.1f}"
                )
        origin = results["backends"][name]["documents"]
        print(f"{'':<11} documents: {', '.join(f'{k} {v}' for k, v in origin.items())}")

    batch = results["settings"]["batch"]
    print(f"\n== batch {batch} in lockstep (mixed schemas): the batch's masks per step, us ==")
    print(f"{'backend':<11} {'mode':<62} {'mean':>8} {'p50':>8} {'p99':>8} {'per token':>9}")
    for name in names:
        for mode, s in results["backends"][name]["batch"]["modes"].items():
            print(f"{name:<11} {mode:<62} {fmt_stats(s['step_us'])} {s['per_token_us']:9.2f}")
    print(
        f"{'':<11} (steps per pass: {s['steps']}, masks per pass: {s['masks_per_pass']}; rows "
        "finish at different steps, so later steps have fewer rows)"
    )

    print("\n== rollback(n) per call, us (mean p50 p99) ==")
    for name in names:
        for key, s in results["backends"][name]["rollback"].items():
            print(f"{name:<11} {key:<14} {fmt_stats(s)}")

    print(f"\n== apply a [{batch}, {VOCAB}] bitmask to fp32 logits, us (mean p50 p99) ==")
    for fn, s in results["apply"].items():
        if "error" in s:
            print(f"{fn:<56} not measured: {s['error']}")
        else:
            print(
                f"{fn:<56} {fmt_stats(s['us'])}  first call {s['first_call_ms']:8.1f} ms"
                f"{'' if s['correct'] else '  WRONG RESULT'}"
                + {True: " (inductor cache was warm)", False: " (inductor cache was cold)"}.get(
                    s.get("inductor_cache_warm_before"), ""
                )
            )

    print("\n== conformance: documents breaking the schema must be refused ==")
    for name in names:
        r = results["backends"][name]["conformance"]
        line = ", ".join(
            f"{schema} ({c['violates']}): {'refused' if c['refused'] else 'ACCEPTED'}"
            for schema, c in r.items()
        )
        print(f"{name:<11} {line}")
    for name, why in results["skipped"].items():
        print(f"\n{name}: skipped -- {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="llguidance,xgrammar")
    parser.add_argument("--reps", type=int, default=5, help="timed passes over each document")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="threads of LLExecutor / BatchGrammarMatcher / GrammarCompiler (default: all CPUs)",
    )
    parser.add_argument("--whitespace", choices=("compact", "flexible"), default="compact")
    parser.add_argument(
        "--no-torch-compile",
        action="store_true",
        help="skip llguidance's apply_token_bitmask_inplace (it runs torch.compile)",
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()

    cpu = cpu_header()
    versions = {"torch": torch.__version__}
    for dist in ("llguidance", "xgrammar", "apache-tvm-ffi", "transformers", "triton"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    print(platform.current().summary())
    print(
        f"cpu: {cpu['model_name']} (family {cpu['family']} model {cpu['model']}), "
        f"avx2 {'yes' if cpu['avx2'] else 'no'}, "
        f"avx512_bf16 {'yes' if cpu['avx512_bf16'] else 'no'}, {cpu['cpus']} cpus; "
        f"torch threads {torch.get_num_threads()} "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    load = os.getloadavg()
    print(
        f"vocab {VOCAB}, eos {EOS_IDS}, {args.whitespace} JSON, batch {args.batch}, "
        f"reps {args.reps}, batch-API threads {args.threads}; load average at start "
        f"{load[0]:.2f} (1 min) on {cpu['cpus']} cpus: a shared machine shows in means and p99"
    )

    backends, skipped = [], {}
    for name in args.backends.split(","):
        if name not in BACKENDS:
            parser.error(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
        try:
            backends.append(BACKENDS[name](args.whitespace, args.threads))
        except Exception as e:  # noqa: BLE001 -- an optional backend: skip it, say why
            skipped[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: skipped -- {skipped[name]}", flush=True)

    results: dict = {
        "settings": {
            "vocab": VOCAB,
            "eos": EOS_IDS,
            "whitespace": args.whitespace,
            "batch": args.batch,
            "reps": args.reps,
            "threads": args.threads,
        },
        "cpu": cpu,
        "load_average_start": load,
        "versions": versions,
        "backends": {},
        "skipped": skipped,
    }
    per_doc = (args.batch + len(SCHEMAS) - 1) // len(SCHEMAS)
    batch_mask = None
    for backend in backends:
        print(f"measuring {backend.name} ...", flush=True)
        r: dict = {}
        r["setup"], compiled = measure_setup(backend, args.reps)
        docs, r["documents"] = documents(backend, compiled, args.whitespace, per_doc)
        r["batch1"] = measure_batch1(backend, compiled, docs, args.reps)
        r["batch"] = measure_batch(backend, compiled, docs, args.batch, args.reps, args.threads)
        r["rollback"] = measure_rollback(backend, compiled, docs, args.reps)
        r["conformance"] = measure_conformance(backend, compiled, args.whitespace)
        results["backends"][backend.name] = r
        if batch_mask is None:  # a real batch's first-step masks for the apply timing
            names = list(compiled)
            batch_mask = bitmask(args.batch)
            for i in range(args.batch):
                backend.fill(backend.matcher(compiled[names[i % len(names)]]), batch_mask, i)
    if batch_mask is None:
        batch_mask = bitmask(args.batch)
    results["apply"] = measure_apply(backends, batch_mask, args.reps, not args.no_torch_compile)

    results["load_average_end"] = os.getloadavg()
    report(results)
    print(f"load average at the end {results['load_average_end'][0]:.2f} (1 min)")
    if args.json:
        results["machine"] = machine_facts("float32", threads=args.threads)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
