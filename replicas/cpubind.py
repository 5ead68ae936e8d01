"""Which CPU cores the workers of each local vLLM replica run on.

vLLM's CPU backend binds a replica's worker threads to cores
(``VLLM_CPU_OMP_THREADS_BIND``). Its default, ``auto``, takes the cores of
"its" NUMA node and cannot see the other replicas on the host, so on a
one-node host every replica's workers land on the same cores, where each
side of vLLM's executor spin-waits between steps: one replica's streams
waited up to 31 s for a token while the other's ran (README, "Several vLLM
replicas on one CPU host"). The supervisor gives each local vLLM replica
cores of its own instead, unless the operator set the variable (in the
router's environment, or in a replica's ``env``: that replica then takes
no share). A replica given a ``gpu`` gets none; vLLM on GPUs ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BIND_ENV", "core_lists", "id_list", "workers"]

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def id_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (vLLM's CPU list syntax)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def core_lists(cpus: Sequence[int], ranks: Sequence[int]) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for replicas with ``ranks[i]`` workers
    each (``workers``) sharing the cores ``cpus``.

    Every worker gets an even share of the cores, contiguous and its own.
    When there are more cores than workers, the last is left out: the
    router, the engines' schedulers and their front ends run there (vLLM's
    ``auto`` also keeps one free). With fewer cores than workers, workers
    share cores round-robin. A replica's workers' lists are joined by ``|``,
    as vLLM reads them. ``cpus`` must not be empty."""
    total = sum(ranks)
    pool = sorted(cpus)
    if len(pool) > total:
        pool = pool[:-1]
    shares: list[list[int]] = []
    if len(pool) >= total:
        size, extra = divmod(len(pool), total)
        at = 0
        for j in range(total):
            n = size + (1 if j < extra else 0)
            shares.append(pool[at:at + n])
            at += n
    else:
        shares = [[pool[j % len(pool)]] for j in range(total)]
    out = []
    at = 0
    for n in ranks:
        out.append("|".join(id_list(s) for s in shares[at:at + n]))
        at += n
    return out


def workers(config: dict) -> int:
    """How many workers (vLLM ranks on this host) a vLLM replica with this
    ``config`` runs: its tensor x pipeline x data parallel sizes."""
    extra = config.get("extra") or {}
    n = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        n *= max(1, int(extra.get(key) or 1))
    return n
