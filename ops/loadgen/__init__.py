"""fairstream load generator.

``python -m ops.loadgen --scenario ops/scenarios/demo.yaml`` drives a router
with a YAML scenario (see ``ops.loadgen.scenario`` for every field), shows a
live progress bar, prints a per-tenant summary table, and writes raw results
(JSON, CSV) and PNG charts into ``--out``.

Modules: ``scenario`` (schema), ``plan`` (what to send: pure, seeded),
``sse`` (incremental SSE parsing), ``client`` (one request, measured),
``runner`` (closed-loop and Poisson drivers), ``scrape`` (router /metrics
once a second), ``stats`` (percentiles, summary; pure), ``report`` (table,
JSON, CSV), ``plots`` (PNGs), ``target`` (loopback guard), ``cli``.
"""

__all__: list[str] = []
