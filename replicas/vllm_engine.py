"""The ``vllm`` engine: vLLM's ``AsyncLLM`` behind the ``Engine`` interface.

The replica server tokenizes prompts itself (``VllmEngine.tokenizer``) and
detokenizes output with ``replicas.output``; this engine only moves token ids.
Requests go to vLLM as ``TokensPrompt`` with ``RequestOutputKind.DELTA`` and
``detokenize=False``. Stop strings are not passed to vLLM (the replica's
``OutputProcessor`` matches them and the server aborts the request); stop token
ids, ``ignore_eos``, ``min_tokens``, the seed and every sampling knob are.

One task per request iterates ``AsyncLLM.generate`` and pushes deltas into the
sink; ``abort`` cancels that task (vLLM's generator aborts the request in the
engine when cancelled) and also aborts by id in case the cancel landed while
the request was being added. Load comes from vLLM's scheduler stats through a
stat logger registered on the engine, clamped to the requests this engine
still has in flight (vLLM reports stats per step, so after the last request
ends the last report would otherwise stay stale).

vLLM is imported in ``start()`` only, so this module imports without it. vLLM
starts its engine core in a child process: code that calls ``start()`` must
run under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from replicas.chat_template import conversation, template_variables
from replicas.engine import Engine, EngineDead, EngineError, OutputSink, Tokenizer
from replicas.protocol import (
    REFUSED_TEMPLATE_KWARGS,
    UNSET_FREQUENCY_PENALTY,
    UNSET_MIN_P,
    UNSET_PRESENCE_PENALTY,
    UNSET_REPETITION_PENALTY,
    UNSET_TEMPERATURE,
    UNSET_TOP_K,
    UNSET_TOP_P,
    FinishReason,
    LoadReport,
    SamplingParams,
)

__all__ = ["VllmEngine", "VllmEngineConfig", "HfTokenizer", "splice_penalties", "spliced_penalties_fit", "SPLICE_KEY",
           "LOGITS_PROCESSOR"]

log = logging.getLogger(__name__)

_GIB = 1 << 30

# A continued request's penalties (replicas.vllm_penalties): the key of
# SamplingParams.extra_args that carries them, and the logits processor,
# by name, that vLLM loads in its engine core to apply them.
SPLICE_KEY = "fairstream_splice"
LOGITS_PROCESSOR = "replicas.vllm_penalties:SplicedPenalties"


def spliced_penalties_fit(on_cpu: bool, engine_kwargs: dict[str, Any], env: dict[str, str]) -> bool:
    """Whether a replica's vLLM can run ``SplicedPenalties``: its V1 model
    runner on a CPU host, without speculative decoding. Elsewhere it is not
    loaded (a continuation's presence and frequency penalties then count from
    the splice on, README "Known limitations"):
    - on a GPU, vLLM 0.32 runs Model Runner V2 wherever Triton is installed,
      which refuses a processor written for the V1 interface (the engine would
      not start), and with its async scheduling any custom processor makes
      every step wait for the previous one's sampled tokens;
    - speculative decoding refuses custom processors;
    - TPUs drop them (and vLLM's own penalties would be left neutral)."""
    if not on_cpu or engine_kwargs.get("speculative_config"):
        return False
    return env.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("1", "true")

# vLLM's CompletionOutput.finish_reason strings -> our codes.
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.STOP,
}



_DEFAULTED = (("temperature", UNSET_TEMPERATURE), ("top_p", UNSET_TOP_P), ("top_k", UNSET_TOP_K),
              ("repetition_penalty", UNSET_REPETITION_PENALTY), ("min_p", UNSET_MIN_P),
              ("presence_penalty", UNSET_PRESENCE_PENALTY), ("frequency_penalty", UNSET_FREQUENCY_PENALTY))


def model_sampling_defaults(model_config: Any) -> dict[str, float]:
    """The sampling values the model's generation config sets that differ
    from vLLM's own (``ModelConfig.get_diff_sampling_param``, what ``vllm
    serve`` applies to a request's unset fields), of the fields the replica
    protocol carries, and ``max_tokens`` (its ``max_new_tokens``, the
    default of a request that sets none: ``model_max_tokens``); {} if this
    vLLM has no such call."""
    diff = getattr(model_config, "get_diff_sampling_param", None)
    if diff is None:
        return {}
    values = diff() or {}
    return {name: values[name] for name, _ in (*_DEFAULTED, ("max_tokens", 0)) if values.get(name) is not None}


def model_max_tokens(defaults: dict[str, float]) -> int | None:
    """The model's ``max_new_tokens`` (``model_sampling_defaults``): what
    ``vllm serve`` limits a request that sets no ``max_tokens`` to, under
    the context the prompt leaves (``get_max_tokens``), where the router's
    own default is higher (``replicas.prepare``)."""
    value = defaults.get("max_tokens")
    return int(value) if value is not None else None


def with_model_defaults(p: SamplingParams, defaults: dict[str, float]) -> tuple[float, ...]:
    """(temperature, top_p, top_k, repetition_penalty, min_p,
    presence_penalty, frequency_penalty) of ``p``, the model's default for
    each the client left unset (top_k an int)."""
    values = [defaults[name] if p.unset & bit and name in defaults else getattr(p, name) for name, bit in _DEFAULTED]
    return tuple(int(v) if name == "top_k" else float(v) for v, (name, _) in zip(values, _DEFAULTED))


def splice_penalties(presence: float, frequency: float, repetition: float,
                     generated: int) -> tuple[float, float, float, dict[str, Any] | None]:
    """(presence, frequency, repetition, extra_args) for vLLM's
    ``SamplingParams`` of a request whose prompt ends with ``generated`` of
    its own output tokens. vLLM counts the first two over the output only, so
    where they are set the three go to ``SplicedPenalties``
    (replicas/vllm_penalties.py), which counts that output too, and vLLM's
    own are left neutral."""
    if generated <= 0 or (presence == 0.0 and frequency == 0.0):
        return presence, frequency, repetition, None
    return 0.0, 0.0, 1.0, {SPLICE_KEY: [presence, frequency, repetition, generated]}


class VllmEngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to start vLLM for one replica."""

    model: str
    """Model directory or Hugging Face name (no downloads on offline hosts)."""
    served_name: str | None = None
    """Model name reported to the router. Unset: ``model``."""
    seed: int = 0
    """Engine seed. Replicas of one model must share it: with ``load_format=dummy``
    it fixes the random weights, and it fixes unseeded sampling."""
    max_model_len: int = 2048
    """Longest prompt + completion in tokens."""
    dtype: str = "float32"
    """Weight and activation dtype (``float32``, ``bfloat16``, ``auto``...)."""
    kv_cache_gib: float | None = 1.0
    """KV cache size in GiB (vLLM ``kv_cache_memory_bytes``); ``None`` lets vLLM
    size it (``gpu_memory_utilization`` on GPUs). ``VLLM_CPU_KVCACHE_SPACE``
    in the environment overrides it on CPU hosts."""
    enforce_eager: bool = True
    """Skip graph capture and compilation: much faster start, needed on CPU."""
    tiny: bool = False
    """Generate the built-in tiny model (``replicas.tinymodel``, seeded random
    weights) into ``model`` when it is missing."""
    load_format: str = "auto"
    """vLLM ``load_format``; ``dummy`` gives random weights from ``seed``."""
    extra: dict[str, Any] = {}
    """More ``AsyncEngineArgs`` keywords, passed through unchanged; they win
    over the fields above."""


class HfTokenizer:
    """``replicas.engine.Tokenizer`` over a Hugging Face tokenizer.

    ``decode`` skips special tokens (no ``</s>`` in completion text) and leaves
    an unfinished UTF-8 sequence as U+FFFD, as byte-level tokenizers do.
    """

    __slots__ = ("_tok", "eos_token_id")

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        # Completion prompts get the model's special tokens (BOS), as in vLLM.
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def chat(self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None,
             reasoning_effort: str | None = None) -> list[int]:
        template = getattr(self._tok, "chat_template", None)
        if not template:
            raise EngineError("the model has no chat template")
        # What vLLM's server renders (replicas.chat_template): its developer
        # turns, and a request's chat_template_kwargs as variables under its
        # own fields (add_generation_prompt stays True, reasoning_effort
        # wins); a variable the template does not use changes nothing.
        # Never the template itself, nor tokenize (vLLM refuses both; the
        # router does before they get here).
        if template_kwargs:
            refused = REFUSED_TEMPLATE_KWARGS & template_kwargs.keys()
            if refused:
                raise EngineError(f"Found unexpected chat template kwargs from request: {sorted(refused)}")
        kwargs = template_variables(template_kwargs, reasoning_effort)
        # (a tokenizer's named templates: one of them names the role, as the one vLLM picks may)
        messages = conversation(messages, template if isinstance(template, str) else str(template))
        # Render to text first: the tokenize=True return type differs between
        # transformers 4 (list) and 5 (BatchEncoding). The template carries BOS.
        try:
            text = self._tok.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # a template's raise_exception, a kwarg it cannot take: the request's fault
            raise EngineError(f"the chat template cannot render this request: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):  # (a kwarg such as return_dict changed what it returns)
            raise EngineError(f"the chat template rendered {type(text).__name__}, not text, with these "
                              "chat_template_kwargs")
        return list(self._tok.encode(text, add_special_tokens=False))


class _SchedulerLoad:
    """Last scheduler stats vLLM reported (written by the stat logger)."""

    __slots__ = ("running", "waiting", "kv_usage", "steps")

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.steps = 0


class VllmEngine(Engine):
    """vLLM ``AsyncLLM`` serving one model in this process (plus vLLM's
    engine-core child process)."""

    name = "vllm"

    def __init__(self, config: VllmEngineConfig, sink: OutputSink) -> None:
        super().__init__(sink)
        self.config = config
        self.model = config.served_name or config.model
        self.max_model_len = config.max_model_len
        self._llm: Any = None
        self._vllm: Any = None  # the vllm names start() imports
        self._defaults: dict[str, float] = {}  # the model's sampling defaults (model_sampling_defaults)
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._req_ids: dict[int, str] = {}
        self._aborts: set[asyncio.Task[None]] = set()
        self._seq = itertools.count()
        self._load = _SchedulerLoad()
        self._tokens_generated = 0
        self._spliced_penalties = False  # SplicedPenalties is loaded (spliced_penalties_fit)
        self.start_seconds = 0.0

    @property
    def dead(self) -> bool:
        """vLLM's engine core has died (started and then failed: its process
        killed, out of memory); every request fails from now on."""
        llm = self._llm
        return self.died.is_set() or (llm is not None and bool(llm.errored))

    async def start(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        if cfg.tiny:
            from replicas.tinymodel import ensure_tiny_model

            await asyncio.to_thread(ensure_tiny_model, Path(cfg.model))
        elif cfg.model.startswith(("/", "./", "../", "~")) and not Path(cfg.model).expanduser().is_dir():
            # (vLLM would take it for a hub repo id and say the name is malformed)
            raise EngineError(f"model directory {cfg.model} does not exist")
        try:
            from vllm import SamplingParams as VllmSamplingParams
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.inputs import TokensPrompt
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.exceptions import EngineDeadError
        except (ImportError, RuntimeError) as e:
            # RuntimeError: e.g. torchvision built for another torch.
            raise EngineError(f"vllm is not installed or does not import: {e}") from e
        self._vllm = (VllmSamplingParams, TokensPrompt, RequestOutputKind, EngineDeadError)

        kwargs: dict[str, Any] = {
            "model": cfg.model,
            "seed": cfg.seed,
            "max_model_len": cfg.max_model_len,
            "dtype": cfg.dtype,
            "enforce_eager": cfg.enforce_eager,
            "load_format": cfg.load_format,
            # Our stat logger below keeps the scheduler stats flowing; vLLM's
            # own periodic log lines stay off.
            "disable_log_stats": True,
        }
        if cfg.served_name:
            kwargs["served_model_name"] = cfg.served_name
        if cfg.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * _GIB)
        kwargs.update(cfg.extra)
        from vllm.platforms import current_platform

        self._spliced_penalties = spliced_penalties_fit(current_platform.is_cpu(), kwargs, dict(os.environ))
        if self._spliced_penalties:
            kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or ()), LOGITS_PROCESSOR]
        else:
            log.info("presence and frequency penalties of a stream continued here count from the splice on "
                     "(the penalties' logits processor runs on vLLM's V1 runner on a CPU host only)")
        args = AsyncEngineArgs(**kwargs)
        factory = _stat_logger_factory(self._load)
        # Building the engine blocks for the whole model load (~30 s for the
        # tiny model on CPU); keep the event loop free meanwhile.
        try:
            self._llm = await asyncio.to_thread(
                AsyncLLM.from_engine_args, args, stat_loggers=[factory]
            )
        except Exception as e:
            raise EngineError(f"vLLM failed to start: {type(e).__name__}: {e}") from e
        self.tokenizer: Tokenizer = HfTokenizer(self._llm.get_tokenizer())
        self.max_model_len = self._llm.model_config.max_model_len
        self._defaults = model_sampling_defaults(self._llm.model_config)
        self.default_max_tokens = model_max_tokens(self._defaults)
        if self._defaults:
            log.info("the model's sampling defaults (generation config), for fields a request leaves unset: %s",
                     self._defaults)
        self.start_seconds = time.monotonic() - t0
        log.info("vLLM engine for %s ready in %.1f s", cfg.model, self.start_seconds)

    def add(self, rid: int, token_ids: list[int], params: SamplingParams, generated: int = 0) -> None:
        llm = self._llm
        if llm is None:
            raise EngineError("engine not started")
        if llm.errored:
            self.die("vLLM engine is dead")
            raise EngineDead("vLLM engine is dead")
        if rid in self._tasks:
            raise EngineError(f"request {rid} is already running")
        if not token_ids:
            raise EngineError("empty prompt")
        if len(token_ids) >= self.max_model_len:
            raise EngineError(
                f"prompt has {len(token_ids)} tokens; this model takes at most "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len})"
            )
        sp = self._sampling_params(params, generated)
        # Unique per attempt: a rid may be reused right after an abort, before
        # vLLM has dropped the old request.
        req_id = f"{rid}-{next(self._seq)}"
        self._req_ids[rid] = req_id
        self._tasks[rid] = asyncio.create_task(
            self._run(rid, req_id, list(token_ids), sp), name=f"vllm-{req_id}"
        )

    def _sampling_params(self, p: SamplingParams, generated: int = 0) -> Any:
        VllmSamplingParams, _, RequestOutputKind, _ = self._vllm
        temperature, top_p, top_k, repetition_penalty, min_p, presence, frequency = with_model_defaults(
            p, self._defaults)
        presence, frequency, repetition, extra = splice_penalties(
            presence, frequency, repetition_penalty, generated if self._spliced_penalties else 0)
        try:
            return VllmSamplingParams(
                n=1,
                max_tokens=p.max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k > 0 else 0,
                min_p=min_p,
                seed=p.seed,
                stop_token_ids=list(p.stop_token_ids) or None,
                ignore_eos=p.ignore_eos,
                min_tokens=p.min_tokens,
                presence_penalty=presence,
                frequency_penalty=frequency,
                repetition_penalty=repetition,
                extra_args=extra,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
        except (ValueError, TypeError) as e:
            raise EngineError(f"bad sampling parameters: {e}") from e

    async def _run(self, rid: int, req_id: str, prompt: list[int], sp: Any) -> None:
        _, TokensPrompt, _, EngineDeadError = self._vllm
        sink = self.sink
        try:
            gen = self._llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, req_id)
            async for out in gen:
                c = out.outputs[0]
                ids = list(c.token_ids)
                finish = FinishReason.NONE
                if c.finish_reason is not None:
                    finish = _FINISH.get(c.finish_reason, FinishReason.STOP)
                elif out.finished:
                    finish = FinishReason.STOP
                self._tokens_generated += len(ids)
                if ids or finish != FinishReason.NONE:
                    # (vLLM's stop_reason: an int is the stop token that ended it, among them the
                    # EOS ids it adds from the generation config, which the params do not name)
                    reason = getattr(c, "stop_reason", None)
                    sink(rid, ids, finish, "", reason if type(reason) is int else None)
        except asyncio.CancelledError:
            raise  # abort(): no further output
        except EngineDeadError as e:
            # not this request's fault: no answer (the router fails it over
            # when this process drops its connection)
            self.die(f"vLLM engine is dead: {e}")
        except Exception as e:
            cause = e.__cause__ or e
            # (vLLM's own message, as its server gives it; the class name only when there is none)
            sink(rid, [], FinishReason.ERROR, str(cause) or type(cause).__name__)
        finally:
            if self._req_ids.get(rid) == req_id:
                del self._req_ids[rid]
                self._tasks.pop(rid, None)

    def abort(self, rid: int) -> None:
        task = self._tasks.pop(rid, None)
        req_id = self._req_ids.pop(rid, None)
        if task is None or req_id is None:
            return
        task.cancel()
        llm = self._llm
        if llm is not None and not llm.errored:
            # The cancelled generator aborts in vLLM too; this covers a cancel
            # that lands before generate() has registered the request.
            t = asyncio.get_running_loop().create_task(self._abort_in(llm, req_id))
            self._aborts.add(t)
            t.add_done_callback(self._aborts.discard)

    def load(self) -> LoadReport:
        s = self._load
        n = len(self._tasks)
        running = min(s.running, n)
        return LoadReport(
            running=running,
            waiting=n - running,
            kv_usage=s.kv_usage if n else 0.0,
            steps=s.steps,
            tokens_generated=self._tokens_generated,
            reports_steps=True,  # (one per scheduler stats record: vLLM's engine steps)
        )

    async def _abort_in(self, llm: Any, req_id: str) -> None:
        try:
            await llm.abort(req_id)
        except Exception:  # (a healthy engine's failure: the request may go on using KV cache, unseen)
            healthy = self._llm is llm and not llm.errored  # (close() takes _llm first)
            log.log(logging.WARNING if healthy else logging.DEBUG, "abort of %s failed%s", req_id,
                    ": it may go on in the engine, using KV cache, until it ends" if healthy else "", exc_info=True)

    async def close(self) -> None:
        llm, self._llm = self._llm, None  # (first: an abort failing meanwhile is of a closing engine)
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._req_ids.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *self._aborts, return_exceptions=True)
        if llm is not None:
            # vLLM's shutdown stops the engine core, then cancels its output
            # handler task; run in a thread, it let that task (on this loop)
            # read the stopped core in between and log ERROR "AsyncLLM
            # output_handler failed ... EngineDeadError" at a clean stop. So
            # the task goes first (vLLM 0.32: ``AsyncLLM.output_handler``).
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            await asyncio.to_thread(llm.shutdown)


def _stat_logger_factory(load: _SchedulerLoad) -> Any:
    """A vLLM per-engine stat logger factory that copies scheduler stats into
    ``load``. vLLM calls ``record`` from its output handler task, on our loop."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._load = load

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            ld = self._load
            ld.running = scheduler_stats.num_running_reqs
            ld.waiting = scheduler_stats.num_waiting_reqs
            ld.kv_usage = float(scheduler_stats.kv_cache_usage)
            ld.steps += 1

        def log_engine_initialized(self) -> None:
            pass

    return _LoadLogger
