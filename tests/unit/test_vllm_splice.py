"""What a ``vllm`` replica tells vLLM about a continued request's penalties
(replicas/vllm_penalties.py applies them; tests/vllm checks the tokens)."""

from __future__ import annotations

import importlib.util

from replicas.vllm_engine import LOGITS_PROCESSOR, SPLICE_KEY, splice_penalties


def test_a_request_without_a_splice_or_output_penalties_keeps_vllms_own():
    assert splice_penalties(0.5, 0.25, 1.1, 0) == (0.5, 0.25, 1.1, None)
    # repetition counts the prompt too: the same tokens either way
    assert splice_penalties(0.0, 0.0, 1.3, 12) == (0.0, 0.0, 1.3, None)


def test_a_continuation_with_output_penalties_moves_all_three_to_the_processor():
    assert splice_penalties(0.5, 0.0, 1.1, 12) == (0.0, 0.0, 1.0, {SPLICE_KEY: [0.5, 0.0, 1.1, 12]})
    assert splice_penalties(0.0, -0.5, 1.0, 1) == (0.0, 0.0, 1.0, {SPLICE_KEY: [0.0, -0.5, 1.0, 1]})


def test_the_processor_is_named_where_vllm_can_import_it():
    module, _, name = LOGITS_PROCESSOR.partition(":")
    assert module == "replicas.vllm_penalties" and name == "SplicedPenalties"
    spec = importlib.util.find_spec(module)  # (importing it needs vLLM)
    assert spec is not None and spec.origin is not None
    with open(spec.origin, encoding="utf-8") as f:
        assert f"class {name}(" in f.read()


def test_the_processor_is_loaded_only_where_vllms_v1_runner_runs_it():
    from replicas.vllm_engine import spliced_penalties_fit

    assert spliced_penalties_fit(True, {"model": "m"}, {})
    assert spliced_penalties_fit(True, {}, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert not spliced_penalties_fit(False, {}, {})  # a GPU: Model Runner V2 refuses it
    assert not spliced_penalties_fit(True, {}, {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert not spliced_penalties_fit(True, {"speculative_config": {"method": "ngram"}}, {})
