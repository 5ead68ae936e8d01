"""A tenants file reloaded is parsed and checked in a child process.

In a thread, parsing a large file held up the event loop: the parse builds a
node and a value for every scalar (a 5,000-tenant file, 700 KB: millions of
objects), and the young-generation collections that allocation sets off run
while holding the interpreter, in whichever thread allocates, as does the
collection of the generation they fill; streams paused 0.3-0.8 s at once.
The child runs ``load_yaml`` itself, so a bad file's errors are those
``check-config`` and a start give, and sends back the checked file as
msgpack (or the errors); the router only decodes it (C, a few ms).

    python -m router.tenants_parse PATH < text     (PATH names the file in errors)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec

from router.configfile import ConfigError, load_yaml
from router.tenants import TenantsFile

__all__ = ["parse_elsewhere", "decode"]


class _Parsed(msgspec.Struct):
    """What the child writes: the file, or the errors that refuse it."""

    file: TenantsFile | None = None
    errors: list[str] = []


async def parse_elsewhere(path: Path, text: str) -> bytes:
    """``load_yaml(path, TenantsFile, text)`` in a child process: its
    answer, for ``decode`` (in a thread: it builds the file's structs)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.tenants_parse", str(path),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await proc.communicate(text.encode("utf-8"))
    finally:
        if proc.returncode is None:  # (the reload was cancelled: the router is stopping)
            proc.kill()
            await proc.wait()
    if proc.returncode != 0 or not out:
        why = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise ConfigError([f"{path}:1: (file): the process that parses it failed: {why[0]}"])
    return out


def decode(answer: bytes) -> TenantsFile:
    """The file ``parse_elsewhere`` answered; ``ConfigError`` with its errors."""
    parsed = msgspec.msgpack.decode(answer, type=_Parsed)
    if parsed.errors or parsed.file is None:
        raise ConfigError(parsed.errors)
    return parsed.file


def main() -> None:
    path = sys.argv[1]
    text = sys.stdin.buffer.read().decode("utf-8")
    try:
        parsed = _Parsed(file=load_yaml(path, TenantsFile, text)[0])
    except ConfigError as e:
        parsed = _Parsed(errors=e.errors)
    sys.stdout.buffer.write(msgspec.msgpack.encode(parsed))


if __name__ == "__main__":
    main()
