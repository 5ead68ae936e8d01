"""What a failed attempt to start or reach a replica says about whose fault it is."""

from __future__ import annotations

import errno

from replicas.client import ReplicaDead, ReplicaRefused

__all__ = ["not_reached", "out_of_descriptors"]


def not_reached(e: BaseException) -> bool:
    """A connect that did not get through (refused, no route, no socket file,
    timed out, closed before any answer), as opposed to a replica that
    answered with an error (``ReplicaDead``: a bad handshake, an upstream's
    5xx on ``/models``; ``ReplicaRefused``: a wrong secret or key; a TLS
    failure: a certificate it presented), which keeps the backoff.
    (aiohttp's connect errors and ``TimeoutError`` are ``OSError`` too.)"""
    import ssl

    from aiohttp import ClientSSLError

    return isinstance(e, OSError) and not isinstance(e, (ReplicaDead, ReplicaRefused, ssl.SSLError, ClientSSLError))


def out_of_descriptors(e: BaseException | None) -> bool:
    """The router itself out of file descriptors (EMFILE; ENFILE: the
    system's), in ``e`` or what caused it: the router's want, which passes
    with a flood of client connections, not the replica's fault."""
    for _ in range(8):  # (a chain of causes is short: no cycle followed for ever)
        if e is None:
            return False
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return True
        e = e.__cause__ or e.__context__
    return False
