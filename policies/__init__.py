"""Pure decisions: no asyncio, no sockets, no Redis. Clock and rng are passed in."""
