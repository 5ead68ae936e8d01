"""vLLM's output penalties across a splice: a continued request penalized as
if it had produced its whole output itself.

A request continued after a failover or a resume reaches vLLM as the
original prompt plus the tokens already delivered (``prefix``). vLLM counts
``presence_penalty`` and ``frequency_penalty`` over a request's output only,
so from the splice on it would count only the new tokens, and a greedy
stream would not be token-exact. ``repetition_penalty`` counts the prompt
too, so its token set is the same either way, but vLLM applies it before
the other two (a multiplication, then subtractions), so the three move
together.

``VllmEngine`` sends such a request with vLLM's own three penalties neutral
(which vLLM then applies as the identity: x * 1.0 - 0.0) and the real values
in ``SamplingParams.extra_args[SPLICE_KEY]``: ``[presence, frequency,
repetition, generated]``, ``generated`` being how many of the prompt's last
tokens are the request's own output. ``SplicedPenalties`` applies them with
vLLM's own ``apply_penalties`` (the same arithmetic, element by element, so
the logits are bit-for-bit those of the uninterrupted request) over the
original prompt and ``prefix + new output``. It runs where vLLM runs custom
logits processors: after its built-in ones that can change the argmax
(``logit_bias``, ``min_tokens``; the router sends neither a bias nor
``min_tokens`` a continuation has already met) and before its penalties,
temperature and sampling.

Loaded by vLLM in its engine core, by name (``LOGITS_PROCESSOR``), so this
module imports vLLM and torch at the top; the rest of the replica never
imports it. It is written for vLLM's V1 model runner, and ``VllmEngine``
loads it only where that runner runs it (``spliced_penalties_fit``: a CPU
host, no speculative decoding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from vllm import SamplingParams
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from replicas.vllm_engine import SPLICE_KEY

__all__ = ["SplicedPenalties"]


class _Row:
    """One continued request in the batch."""

    __slots__ = ("prompt", "prefix", "output", "presence", "frequency", "repetition")

    def __init__(self, prompt: list[int], prefix: list[int], output: list[int], presence: float, frequency: float,
                 repetition: float) -> None:
        # (made tensors once: only the output after the splice changes)
        self.prompt = torch.tensor(prompt, dtype=torch.int64)
        self.prefix = torch.tensor(prefix, dtype=torch.int64)
        self.output = output  # vLLM's live list of the tokens generated since the splice
        self.presence = presence
        self.frequency = frequency
        self.repetition = repetition


def _spec(params: SamplingParams) -> list[Any] | None:
    extra = params.extra_args
    return None if not extra else extra.get(SPLICE_KEY)


class SplicedPenalties(LogitsProcessor):
    """presence, frequency and repetition penalties over a continued
    request's whole output (the prefix delivered before the splice and what
    it generates now)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}  # batch index -> its continued request

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        spec = _spec(sampling_params)
        if spec is None:
            return
        if (not isinstance(spec, (list, tuple)) or len(spec) != 4 or not isinstance(spec[3], int) or spec[3] <= 0
                or not all(isinstance(v, (int, float)) for v in spec[:3])):
            raise ValueError(f"{SPLICE_KEY} must be [presence, frequency, repetition, generated > 0], got {spec!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # penalties change which token is the most likely

    @staticmethod
    def _new_row(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        spec = _spec(params)
        if spec is None or not prompt_ids:
            return None
        presence, frequency, repetition, generated = spec
        generated = min(int(generated), len(prompt_ids))
        cut = len(prompt_ids) - generated
        return _Row(list(prompt_ids[:cut]), list(prompt_ids[cut:]), output_ids, float(presence), float(frequency),
                    float(repetition))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(i for i in self.rows if i < logits.shape[0])
        if not index:
            return logits
        rows = [self.rows[i] for i in index]
        pad = logits.shape[1]  # vLLM's pad too: past every token id, cut off when counting
        # (-1: a placeholder for a token not sampled yet, under async scheduling)
        outputs = [torch.cat((r.prefix, torch.tensor([t for t in r.output if t >= 0], dtype=torch.int64)))
                   for r in rows]
        device = logits.device
        prompt_t = pad_sequence([r.prompt for r in rows], batch_first=True, padding_value=pad)
        output_t = pad_sequence(outputs, batch_first=True, padding_value=pad)
        where = torch.tensor(index, dtype=torch.int64, device=device)
        part = apply_penalties(
            logits.index_select(0, where),
            prompt_t.to(device),
            output_t.to(device),
            torch.tensor([r.presence for r in rows], dtype=logits.dtype, device=device),
            torch.tensor([r.frequency for r in rows], dtype=logits.dtype, device=device),
            torch.tensor([r.repetition for r in rows], dtype=logits.dtype, device=device),
        )
        logits.index_copy_(0, where, part)
        return logits
