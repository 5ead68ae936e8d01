"""A tenants file reloaded is parsed and checked in a child process.

In a thread, parsing a large file held up the event loop: the parse builds a
node and a value for every scalar (a 5,000-tenant file, 700 KB: millions of
objects), and the young-generation collections that allocation sets off run
while holding the interpreter, in whichever thread allocates, as does the
collection of the generation they fill; streams paused 0.3-0.8 s at once.
The child runs ``load_yaml`` itself, so a bad file's errors are those
``check-config`` and a start give, and sends back the checked file as
msgpack (or the errors); the router only decodes it (C, a few ms).

    python -P -m router.tenants_parse PATH < text     (PATH names the file in errors)

The child imports the router package this process imported (``-P``: not
the cwd's; its root first on PYTHONPATH), as it is on disk now: after
upgrading the code, restart the router (``decode`` says so when the
answer does not fit this process's structs).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import msgspec

import router
from router.configfile import ConfigError, load_yaml
from router.tenants import TenantsFile

__all__ = ["parse_elsewhere", "decode", "ParseUnavailable"]


class ParseUnavailable(ConfigError):
    """The file could not be checked for a reason of the moment (the child
    could not be started, or died), not for what it says: worth trying again
    with the same text (``PolicyRegistry`` does, on its own)."""


class _Parsed(msgspec.Struct):
    """What the child writes: the file, or the errors that refuse it."""

    file: TenantsFile | None = None
    # (bytes, surrogateescape: a path that is not UTF-8 puts lone surrogates
    # in the messages, which msgpack's str cannot carry)
    errors: list[bytes] = []


_ROOT = str(Path(router.__file__).resolve().parents[1])  # (the directory holding this ``router`` package)


async def parse_elsewhere(path: Path, text: str) -> bytes:
    """``load_yaml(path, TenantsFile, text)`` in a child process: its
    answer, for ``decode`` (in a thread: it builds the file's structs).
    ``ConfigError`` if the child cannot be started or fails."""
    from replicas.procstop import die_with_parent  # (here: the child, which imports this module, needs it not)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    try:
        # (die_with_parent: a router killed mid-parse does not leave it parsing)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "router.tenants_parse", str(path), env=env, preexec_fn=die_with_parent,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except OSError as e:  # (EMFILE near the open-file limit, ENOMEM, EAGAIN: as a bad file, not a 500)
        raise ParseUnavailable([f"{path}:1: (file): cannot start the process that parses it: {e}"]) from e
    try:
        out, err = await proc.communicate(text.encode("utf-8"))
    finally:
        if proc.returncode is None:  # (the reload was cancelled: the router is stopping)
            proc.kill()
            await proc.wait()
    if proc.returncode != 0 or not out:
        why = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise ParseUnavailable([f"{path}:1: (file): the process that parses it failed: {why[0]}"])
    return out


def decode(answer: bytes, path: Path) -> TenantsFile:
    """The file ``parse_elsewhere`` answered; ``ConfigError`` with its errors."""
    try:
        parsed = msgspec.msgpack.decode(answer, type=_Parsed)
    except msgspec.MsgspecError as e:  # (DecodeError, ValidationError)
        raise ConfigError([f"{path}:1: (file): the process that parses it answered what this router cannot read "
                           f"({e}): it runs other code than this router; restart the router after upgrading "
                           "it"]) from e
    if parsed.errors or parsed.file is None:
        raise ConfigError([error.decode("utf-8", "surrogateescape") for error in parsed.errors])
    return parsed.file


def main() -> None:
    path = sys.argv[1]
    text = sys.stdin.buffer.read().decode("utf-8")
    try:
        parsed = _Parsed(file=load_yaml(path, TenantsFile, text)[0])
    except ConfigError as e:
        parsed = _Parsed(errors=[error.encode("utf-8", "surrogateescape") for error in e.errors])
    sys.stdout.buffer.write(msgspec.msgpack.encode(parsed))


if __name__ == "__main__":
    main()
