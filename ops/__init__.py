"""Operations tooling: load generator, chaos runner, benchmarks, Grafana dashboard, Prometheus rules."""
