"""The router's side of a replica handshake: the replica's first frame.

Read within one timeout in all, not per read: a peer that trickles it (a
byte a second) must not hold the connect, and the replica's slot, in
"starting" for ever. Something that answers but is no replica (an HTTP or TLS
server at the address) is named as such in the error."""

from __future__ import annotations

import asyncio

from replicas.protocol import FrameDecoder, replica_decoder

__all__ = ["read_handshake", "foreign"]


async def read_handshake(name: str, reader: asyncio.StreamReader, timeout: float) -> object:
    """The replica's first frame, within ``timeout`` s in all. ``TimeoutError``
    if nothing came (unreachable, tried again every reconnect_interval);
    ``ReplicaDead`` if something came but no frame (a failure, with backoff)."""
    from replicas.client import ReplicaDead  # (here: replicas.client imports this module)

    decoder = FrameDecoder(replica_decoder())
    got = b""  # (its first bytes: what answered, if not a replica)
    try:
        async with asyncio.timeout(timeout):
            while True:
                data = await reader.read(65536)
                if not data:
                    why = f"replica {name} closed the connection during the handshake"
                    if got:  # (something answered: not a replica of this protocol, or a broken one)
                        raise ReplicaDead(why + foreign(got))
                    # (nothing behind what took the connection: a tunnel or proxy
                    # whose replica is down; the supervisor retries it as unreachable)
                    raise ConnectionResetError(why)
                got = (got + data)[:16]
                try:
                    msgs = decoder.feed(data)
                except ValueError as e:
                    raise ReplicaDead(f"replica {name}: {e}{foreign(got)}") from None
                if msgs:
                    return msgs[0]
    except TimeoutError:
        if not got:  # (nothing answered: unreachable, tried again every reconnect_interval)
            raise TimeoutError(f"replica {name} sent no handshake within {timeout:g}s of connecting") from None
        raise ReplicaDead(f"replica {name} did not finish its handshake within {timeout:g}s "
                          f"(it sent {len(got) if len(got) < 16 else 'some'} bytes of it)") from None


def foreign(first: bytes) -> str:
    """What answered with ``first`` instead of a replica's handshake, for its error ("": not known)."""
    if first[:5] == b"HTTP/" or first[:1] == b"<":
        return " (it answered HTTP: not a fairstream replica; an OpenAI-compatible server is a `url:` upstream)"
    if len(first) >= 2 and first[0] in (0x15, 0x16) and first[1] == 3:
        return " (it answered TLS: not a fairstream replica, which speaks plain TCP)"
    return ""
