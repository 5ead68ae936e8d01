"""Summarize a py-spy ``--format raw`` profile (collapsed stacks) as text.

``python -m ops.bench.flame_summary ops/profiles/S2-fairstream.txt [--self 30] [--inclusive 60] [--only Runner.run]``
prints the share of samples per function, by self time and inclusive of
callees (each function counted once per stack). The collapsed file itself
opens in speedscope or any flame-graph tool.
"""

from __future__ import annotations

import argparse
from collections import Counter

__all__ = ["summarize"]


def _key(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``."""
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})"


def summarize(path: str, top_self: int = 30, top_incl: int = 60, only: str = "") -> str:
    """Shares of the samples whose stack contains ``only`` (all samples if empty)."""
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip()
            if not line:
                continue
            stack, _, n_raw = line.rpartition(" ")
            try:
                n = int(n_raw)
            except ValueError:
                continue
            if only and only not in stack:
                continue
            total += n
            frames = stack.split(";")
            self_t[frames[-1]] += n
            for k in {_key(fr) for fr in frames[1:]}:  # frames[0] is the process
                incl[k] += n
    where = f" with {only!r} on the stack" if only else ""
    out = [f"{path}: {total} samples{where}", "", "self:"]
    out += [f"{100 * n / total:5.1f}%  {f}" for f, n in self_t.most_common(top_self)]
    out += ["", "inclusive:"]
    out += [f"{100 * n / total:5.1f}%  {f}" for f, n in incl.most_common(top_incl)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="flame_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--self", type=int, default=30, dest="top_self")
    p.add_argument("--inclusive", type=int, default=60)
    p.add_argument("--only", default="", help="count only stacks containing this text, e.g. 'Runner.run' "
                   "(the event-loop thread; py-spy also samples blocked helper threads)")
    a = p.parse_args(argv)
    print(summarize(a.file, a.top_self, a.inclusive, a.only))


if __name__ == "__main__":
    main()
