"""Ids key shared state (resume buffers, leases) and name a stream to resume:
unique within a process and across processes, a forked worker included, and
not guessable from another id."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from router.ids import new_id


def test_ids_are_unique_and_24_hex_characters() -> None:
    ids = [new_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids)


def test_an_id_does_not_lead_to_the_next() -> None:
    # a counter behind a fixed prefix (what ids were) fails both: its
    # neighbours share the prefix and differ by one
    ids = [new_id() for _ in range(1_000)]
    assert len({i[:12] for i in ids}) == len(ids)
    assert all(abs(int(b, 16) - int(a, 16)) > 1 << 32 for a, b in zip(ids, ids[1:]))


def test_ids_drawn_on_many_threads_at_once_are_unique() -> None:
    with ThreadPoolExecutor(8) as pool:
        ids = [i for batch in pool.map(lambda _: [new_id() for _ in range(2_000)], range(8)) for i in batch]
    assert len(set(ids)) == len(ids) == 16_000


def test_a_forked_child_draws_its_own_ids() -> None:
    new_id()  # (ids the parent has drawn and not handed out yet must not reach the child)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its first id and leave at once
        try:
            os.write(w, new_id().encode())
        finally:
            os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(pid, 0)
    mine = new_id()
    assert child and child[:12] != mine[:12], (child, mine)
