"""The ``sim`` engine: a simulated continuous-batching engine.

Good enough to demo, test and plan capacity with, on machines without a GPU:

* **Text.** A byte-level Markov chain over a small built-in corpus (English,
  French, German, Japanese, Spanish, a few emoji), so multi-byte characters
  are split across tokens as they are with real byte-level tokenizers. The
  next token is a pure function of the engine seed, the request seed (sampled
  requests only) and the context (the last ``ORDER`` token ids and the
  sequence length), so a generation restarted from prompt + generated tokens
  continues with exactly the same tokens.
* **Sampling.** ``temperature`` 0 is greedy: the token drawn with key 0, the
  same for every request. Otherwise the draw is weighted by the chain's counts;
  the temperature's value does not reshape them. ``min_p``, ``top_k`` and
  ``top_p`` restrict the draw to a prefix of the candidates ranked as the
  model sees them: the greedy token first, then the others by count (ties by
  token id). ``min_p`` keeps the greedy token and the others whose count
  exceeds ``min_p`` times the top count (strictly: the greedy token, the
  model's most likely, ranks above any count tie, so ``min_p=1`` keeps it
  alone, as vLLM's does); ``top_k`` keeps the first k; ``top_p`` the fewest
  of those whose counts reach ``top_p`` of their mass: vLLM's order (min_p,
  then top_k, then top_p over what they leave). So ``top_k=1``, ``min_p=1``
  or a tiny ``top_p`` is greedy at any temperature, and a restriction that
  keeps every candidate changes nothing. ``presence_penalty``,
  ``frequency_penalty`` and ``repetition_penalty`` are ignored.
* **Time.** One engine step costs ``step_base_ms + step_per_seq_ms * decodes +
  step_per_prefill_token_ms * prefill_tokens``; prefill is chunked under a
  token budget per step (``max_num_batched_tokens``), as in vLLM.
* **Memory.** A paged KV cache of ``kv_cache_tokens`` in blocks of
  ``block_size``: a request waits while its prompt does not fit, and the
  newest running request is preempted (recomputed later) when decoding runs
  out of blocks, so ``running``, ``waiting`` and ``kv_usage`` behave like
  vLLM's scheduler stats.
"""

from __future__ import annotations

import asyncio
import bisect
import random
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from replicas.engine import Engine, EngineError, OutputSink
from replicas.protocol import FinishReason, LoadReport, SamplingParams

__all__ = ["SimConfig", "SimEngine", "ByteTokenizer", "EOS", "BOS"]

EOS = 256
BOS = 257
VOCAB = 258
ORDER = 6
_MASK32 = 0xFFFFFFFF


DEFAULT_MODEL = "fairstream-sim"


class SimConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Timing, capacity and model knobs of a ``sim`` replica."""

    model: str = DEFAULT_MODEL
    """Model name the replica serves (what clients put in ``model``)."""
    seed: int = 0
    """Engine seed; replicas that must produce identical text share it."""
    max_model_len: int = 4096
    """Prompt plus completion tokens per request."""
    max_num_seqs: int = 64
    """Requests decoded together at most (vLLM ``max_num_seqs``)."""
    max_num_batched_tokens: int = 2048
    """Tokens processed per step at most (decodes plus prefill chunks)."""
    kv_cache_tokens: int = 131072
    """KV-cache capacity in tokens."""
    block_size: int = 16
    """KV-cache block size in tokens."""
    step_base_ms: float = 4.0
    """Fixed cost of one engine step."""
    step_per_seq_ms: float = 0.05
    """Added step cost per decoding sequence."""
    step_per_prefill_token_ms: float = 0.002
    """Added step cost per prefill token."""
    eos: bool = True
    """End sequences at the corpus's paragraph ends (unless ``ignore_eos``)."""

    def __post_init__(self) -> None:
        for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens", "block_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"`{key}` must be at least 1")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError("`kv_cache_tokens` must hold at least one block (`block_size`)")
        for key in ("step_base_ms", "step_per_seq_ms", "step_per_prefill_token_ms"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"`{key}` must not be negative")


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is end-of-sequence, 257 begin-of-sequence."""

    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", "replace")

    def chat(self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None,
             reasoning_effort: str | None = None) -> list[int]:
        # (the template has no variables: kwargs and reasoning_effort are
        # taken and change nothing, as a Jinja template ignores variables it
        # does not use; nor does it show a message's name or tool_call_id)
        parts = [f"<|{m.get('role', 'user')}|>\n{m.get('content', '')}\n" for m in messages]
        parts.append("<|assistant|>\n")
        return [BOS, *"".join(parts).encode("utf-8")]


def _ranked(toks: list[int], counts: dict[int, int]) -> tuple[list[int], list[int]]:
    """``toks`` by count, highest first (ties by token id), with cumulative counts."""
    order = sorted(toks, key=lambda t: (-counts[t], t))
    cum, total = [], 0
    for t in order:
        total += counts[t]
        cum.append(total)
    return order, cum


class _Chain:
    """Byte-level Markov chain with back-off from ``ORDER`` down to 0.

    Each context maps to its successors sorted by token id with cumulative
    counts (what ``next`` draws from), and the same successors ranked by count
    (what ``next_within`` restricts), also without EOS for contexts that have it.
    """

    def __init__(self, text: str) -> None:
        data = text.strip().encode("utf-8")
        paragraphs = [p for p in data.split(b"\n\n") if p.strip()]
        # The chain walks paragraph after paragraph; a paragraph end may also
        # end the sequence (EOS).
        seq: list[int] = []
        ends: set[int] = set()
        for p in paragraphs:
            seq.extend(p.strip())
            ends.add(len(seq))
            seq.extend(b"\n\n")
        n = len(seq)
        tables: list[dict[tuple[int, ...], dict[int, int]]] = [{} for _ in range(ORDER + 1)]
        for i in range(n):
            nxt = seq[(i) % n]
            for k in range(ORDER + 1):
                ctx = tuple(seq[(i - k + j) % n] for j in range(k))
                counts = tables[k].setdefault(ctx, {})
                counts[nxt] = counts.get(nxt, 0) + 1
                if i in ends:
                    counts[EOS] = counts.get(EOS, 0) + 1
        # ctx -> (toks, cum, ranked, ranked without EOS); see the class docstring.
        self._tables: list[dict[tuple[int, ...], tuple]] = []
        for table in tables:
            frozen = {}
            for ctx, counts in table.items():
                toks = sorted(counts)
                cum, total = [], 0
                for t in toks:
                    total += counts[t]
                    cum.append(total)
                ranked = _ranked(toks, counts)
                no_eos = _ranked(toks[:-1], counts) if EOS in counts else ranked
                frozen[ctx] = (toks, cum, ranked, no_eos)
            self._tables.append(frozen)

    def _entry(self, context: list[int]) -> tuple:
        tail = [t for t in context[-ORDER:] if t < 256]
        for k in range(min(ORDER, len(tail)), -1, -1):
            entry = self._tables[k].get(tuple(tail[len(tail) - k :]))
            if entry is not None:
                return entry
        raise AssertionError("order 0 always exists")

    def next(self, context: list[int], key: int, allow_eos: bool) -> int:
        """The successor drawn with ``key``, weighted by count."""
        entry = self._entry(context)
        toks, cum = entry[0], entry[1]
        if not allow_eos and toks[-1] == EOS:
            toks, cum = toks[:-1], cum[:-1]
            if not toks:
                return 0x20
        r = (key & _MASK32) * cum[-1] >> 32
        return toks[bisect.bisect_right(cum, r)]

    def next_within(
        self, context: list[int], key: int, greedy_key: int, allow_eos: bool, top_k: int, top_p: float,
        min_p: float = 0.0,
    ) -> int:
        """``next(context, key, allow_eos)`` restricted by ``min_p`` and ``top_k``,
        then ``top_p``.

        Candidates rank as ``next(context, greedy_key, allow_eos)`` (the greedy
        token) first, then by count. ``top_k <= 0``, ``top_p >= 1`` and
        ``min_p <= 0`` keep all; when every candidate is kept the answer is
        exactly ``next``'s. Beyond the context lookup it only bisects the
        precomputed lists: no allocation.
        """
        entry = self._entry(context)
        toks, cum = entry[0], entry[1]
        n = len(toks)
        if allow_eos or toks[-1] != EOS:
            ranked, rcum = entry[2]
        else:
            n -= 1
            if n == 0:
                return 0x20
            ranked, rcum = entry[3]
        total = cum[n - 1]
        i = bisect.bisect_right(cum, (greedy_key & _MASK32) * total >> 32, 0, n)
        g = toks[i]
        cg = cum[i] - cum[i - 1] if i else cum[0]
        pos = ranked.index(g)
        # The kept set is the first m of [g, *ranked without g]: ranked[:m] when
        # pos < m, else g plus ranked[:m - 1]. Its mass grows with m.
        m = n if top_k <= 0 else min(top_k, n)
        if min_p > 0.0:
            # The candidates whose count exceeds min_p * the top count are
            # ranked[:lo] (counts fall along it); g is kept in any case.
            # (bisect over the negated counts, which rise along ``ranked``)
            lo = bisect.bisect_left(range(n), -min_p * rcum[0],
                                    key=lambda i: -(rcum[i] - (rcum[i - 1] if i else 0)))
            m = min(m, lo if pos < lo else lo + 1)
        if top_p < 1.0:
            target = top_p * (rcum[m - 1] if pos < m else cg + (rcum[m - 2] if m > 1 else 0))
            if cg >= target:
                mp = 1
            else:
                mp = bisect.bisect_left(rcum, target - cg, 0, n) + 2  # mass cg + rcum[mp - 2]
                if mp > pos:  # g is inside ranked[:mp]: mass is rcum[mp - 1]
                    mp = max(bisect.bisect_left(rcum, target, 0, n) + 1, pos + 1)
            m = min(m, mp)
        r = key & _MASK32
        if m >= n:
            return toks[bisect.bisect_right(cum, r * total >> 32, 0, n)]
        if pos < m:
            return ranked[bisect.bisect_right(rcum, r * rcum[m - 1] >> 32, 0, m)]
        x = r * (cg + (rcum[m - 2] if m > 1 else 0)) >> 32
        if x < cg:
            return g
        return ranked[bisect.bisect_right(rcum, x - cg, 0, m - 1)]


_CHAIN: _Chain | None = None


def _chain() -> _Chain:
    global _CHAIN
    if _CHAIN is None:
        _CHAIN = _Chain((Path(__file__).parent / "corpus.txt").read_text("utf-8"))
    return _CHAIN


class _Seq:
    __slots__ = ("rid", "tokens", "params", "computed", "generated", "blocks", "key", "restricted")

    def __init__(self, rid: int, tokens: list[int], params: SamplingParams, key: int, restricted: bool) -> None:
        self.rid = rid
        self.tokens = tokens
        self.params = params
        self.computed = 0  # tokens with KV computed
        self.generated = 0
        self.blocks = 0
        self.key = key
        self.restricted = restricted  # sampled with top_k > 1, top_p < 1 or min_p > 0


class SimEngine(Engine):
    name = "sim"

    def __init__(self, config: SimConfig, sink: OutputSink) -> None:
        super().__init__(sink)
        self.config = config
        self.model = config.model
        self.max_model_len = config.max_model_len
        self.tokenizer = ByteTokenizer()
        self._total_blocks = max(1, config.kv_cache_tokens // config.block_size)
        self._free_blocks = self._total_blocks
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_rid: dict[int, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._steps = 0
        self._generated = 0

    async def start(self) -> None:
        _chain()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    def add(self, rid: int, token_ids: list[int], params: SamplingParams, generated: int = 0) -> None:
        if rid in self._by_rid:
            raise EngineError(f"request {rid} already running")
        top = max(token_ids, default=0)
        if top >= VOCAB:  # (vLLM's check and words: its processor's _validate_model_input)
            raise EngineError(f"Token id {top} is out of vocabulary")
        if len(token_ids) >= self.max_model_len:
            raise EngineError(
                f"prompt has {len(token_ids)} tokens; this model's limit is {self.max_model_len}"
            )
        if self._blocks_for(len(token_ids) + 1) > self._total_blocks:
            raise EngineError("prompt does not fit in the KV cache")
        # Greedy is key 0. As in vLLM, temperature 0 ignores top_k/top_p/min_p,
        # and top_k=1 or min_p=1 is greedy at any temperature.
        restricted = False
        if params.temperature <= 0 or params.top_k == 1 or params.min_p >= 1.0:
            key = 0
        else:
            # (seed -1 would be key 0, the greedy draw)
            key = (params.seed + 1 or 1 << 63) if params.seed is not None else random.getrandbits(62) + 1
            restricted = params.top_k > 1 or params.top_p < 1.0 or params.min_p > 0.0
        seq = _Seq(rid, list(token_ids), params, key, restricted)
        self._by_rid[rid] = seq
        self._waiting.append(seq)
        self._wake.set()

    def abort(self, rid: int) -> None:
        seq = self._by_rid.pop(rid, None)
        if seq is None:
            return
        if seq in self._running:
            self._running.remove(seq)
        else:
            try:
                self._waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)

    def load(self) -> LoadReport:
        return LoadReport(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=1.0 - self._free_blocks / self._total_blocks,
            steps=self._steps,
            tokens_generated=self._generated,
            reports_steps=True,
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # -- internals ---------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _release(self, seq: _Seq) -> None:
        self._free_blocks += seq.blocks
        seq.blocks = 0

    def _grow(self, seq: _Seq, tokens: int) -> bool:
        need = self._blocks_for(tokens) - seq.blocks
        if need <= 0:
            return True
        if need > self._free_blocks:
            return False
        self._free_blocks -= need
        seq.blocks += need
        return True

    def _preempt_newest(self) -> None:
        victim = self._running.pop()
        self._release(victim)
        victim.computed = 0
        self._waiting.appendleft(victim)

    def _schedule(self) -> tuple[list[_Seq], int]:
        """Pick this step's work; return (sequences that produce a token, prefill tokens)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        emitting: list[_Seq] = []
        prefill = 0
        # Decodes first, as vLLM does; preempt the newest when blocks run out.
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            if seq.computed < len(seq.tokens) - 1 or budget <= 0:
                i += 1
                continue
            if not self._grow(seq, len(seq.tokens) + 1):
                if self._running[-1] is seq and len(self._running) == 1:
                    i += 1
                    continue
                self._preempt_newest()
                continue
            budget -= 1
            emitting.append(seq)
            i += 1
        # Continue chunked prefills of running sequences, then admit waiting ones.
        candidates = [s for s in self._running if s.computed < len(s.tokens) - 1]
        while self._waiting and len(self._running) < cfg.max_num_seqs and budget > 0:
            seq = self._waiting[0]
            if not self._grow(seq, len(seq.tokens) + 1):
                break
            self._waiting.popleft()
            self._running.append(seq)
            candidates.append(seq)
        for seq in candidates:
            if budget <= 0:
                break
            todo = len(seq.tokens) - seq.computed
            chunk = min(todo, budget)
            seq.computed += chunk
            budget -= chunk
            prefill += chunk
            if seq.computed == len(seq.tokens):
                seq.computed -= 1  # the last token is "computed" by the emitting step
                emitting.append(seq)
        return emitting, prefill

    async def _run(self) -> None:
        cfg = self.config
        chain = _chain()
        seed = cfg.seed
        sink = self.sink
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            emitting, prefill = self._schedule()
            step_ms = (
                cfg.step_base_ms
                + cfg.step_per_seq_ms * len(emitting)
                + cfg.step_per_prefill_token_ms * prefill
            )
            await asyncio.sleep(step_ms / 1000.0)
            self._steps += 1
            for seq in emitting:
                if self._by_rid.get(seq.rid) is not seq:
                    continue  # aborted during the step
                toks = seq.tokens
                params = seq.params
                allow_eos = cfg.eos and not params.ignore_eos and seq.generated >= params.min_tokens
                if seq.restricted:
                    n, tail = len(toks), toks[-ORDER:]
                    tok = chain.next_within(
                        toks, hash((seed, seq.key, n, *tail)), hash((seed, 0, n, *tail)),
                        allow_eos, params.top_k, params.top_p, params.min_p,
                    )
                else:
                    tok = chain.next(toks, hash((seed, seq.key, len(toks), *toks[-ORDER:])), allow_eos)
                toks.append(tok)
                seq.computed = len(toks) - 1
                seq.generated += 1
                self._generated += 1
                finish = FinishReason.NONE
                if tok == EOS or tok in params.stop_token_ids and seq.generated > params.min_tokens:
                    finish = FinishReason.STOP
                elif seq.generated >= params.max_tokens or len(toks) >= self.max_model_len:
                    finish = FinishReason.LENGTH
                if finish != FinishReason.NONE:
                    self._running.remove(seq)
                    del self._by_rid[seq.rid]
                    self._release(seq)
                sink(seq.rid, [tok], finish, "")
