"""Side-by-side router benchmark (issue 7): ``python -m ops.bench --rounds 2``.

Drives the same bounded, loopback-only streaming load against a fast mock
OpenAI upstream directly, fairstream in front of it, vllm-router, LiteLLM
proxy, and fairstream with its own sim replicas against those replicas
reached directly; prints markdown tables and PASS/MISS per target. See
docs/perf.md.
"""
