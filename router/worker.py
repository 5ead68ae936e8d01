"""One worker process of ``fairstream serve --workers N`` (started by router.workers)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path

__all__ = ["main"]


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main() -> None:
    # (it starts with SIGHUP ignored, router.workers._worker_preexec, until
    # its router's reload handler is in)
    import msgspec

    from router.app import create_app
    from router.config import FORCE_SIGNAL, RouterConfig
    from router.configfile import ConfigError
    from router.logs import setup_logging
    from router.server import Server

    p = argparse.ArgumentParser(prog="fairstream-worker")
    p.add_argument("--config-file", required=True, help="the router config as JSON, in this file")
    p.add_argument("--tenants", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="json")
    args = p.parse_args()
    setup_logging(args.log_level, json=args.log_format == "json", worker=True)
    config = msgspec.json.decode(Path(args.config_file).read_bytes(), type=RouterConfig)
    try:
        app = create_app(config, Path(args.tenants))
    except ConfigError as e:  # (the tenants file broke after the parent checked it)
        print("\n".join(e.errors), file=sys.stderr)
        raise SystemExit(1) from None
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    _exit_with_parent()
    Server(app, force_signal=FORCE_SIGNAL).run(sockets=[sock])


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        # (Ctrl-C at a terminal reaches every process of its group: a worker
        # still starting, before its server's handlers are in, has nothing to
        # drain, and the parent stops everything; a traceback said nothing)
        raise SystemExit(130) from None
