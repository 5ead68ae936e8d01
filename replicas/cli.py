"""Command line of a replica process."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import sys

from replicas.engine import EngineError
from replicas.logs import (LOG_FORMAT_ENV, LOG_LEVEL_ENV, REPLICA_NAME_ENV, JsonFormatter, setup_logging,
                           write_error_file)
from replicas.spec import host_port

__all__ = ["main", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                   help="the built-in simulator or vLLM (default: %(default)s)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", help="listen on this Unix socket path")
    where.add_argument("--listen", metavar="HOST:PORT", help="listen on HOST:PORT (remote replicas)")
    where.add_argument(
        "--openai",
        metavar="HOST:PORT",
        help="serve an OpenAI-compatible HTTP API (like `vllm serve`) on HOST:PORT instead of "
        "the replica protocol; the secret, if set, is the API key (see docs/upstreams.md)",
    )
    p.add_argument(
        "--no-token-ids",
        action="store_true",
        help="with --openai: ignore return_token_ids, like an upstream that cannot return "
        "token ids (a test and demo switch)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="with --openai: tokens per streamed chunk after the first (vLLM's --stream-interval) "
        "(default: %(default)s)",
    )
    p.add_argument("--config-json", default="{}", metavar="JSON", help="engine settings as a JSON object (default: %(default)s)")
    p.add_argument(
        "--secret-env",
        default="FAIRSTREAM_REPLICA_SECRET",
        metavar="NAME",
        help="environment variable with the shared secret routers must present (default: %(default)s)",
    )
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default=os.environ.get(LOG_LEVEL_ENV, "info"),
                   choices=["debug", "info", "warning", "error"],
                   help=f"least severe level logged (default: ${LOG_LEVEL_ENV}, else info)")
    p.add_argument(
        "--log-format",
        default=os.environ.get(LOG_FORMAT_ENV, "json"),
        choices=["json", "text"],
        help=f"one JSON object per line, or plain text (default: ${LOG_FORMAT_ENV}, else json; "
        "a router's replicas follow its format through it)",
    )


def run(args: argparse.Namespace) -> None:
    name = os.environ.get(REPLICA_NAME_ENV, "")
    setup_logging(args.log_level, json=args.log_format == "json",
                  formatter=JsonFormatter({"replica": name} if name else None),
                  text_format=f"%(asctime)s replica{' ' + name if name else ''} %(levelname)s %(message)s",
                  lean=False)
    if not args.openai and (args.no_token_ids or args.stream_interval != 1):
        # (they were accepted and ignored: a replica that was meant to stand in for vLLM did not)
        sys.exit("fairstream replica: --no-token-ids and --stream-interval apply to --openai only")
    try:
        config = json.loads(args.config_json)
    except ValueError as e:
        sys.exit(f"fairstream replica: --config-json is not JSON: {e}")
    if not isinstance(config, dict):
        sys.exit("fairstream replica: --config-json must be a JSON object")
    secret = os.environ.get(args.secret_env, "")
    host = port = None
    if args.listen or args.openai:
        where = args.listen or args.openai
        parsed = host_port(where)
        if parsed is None:
            option = "--listen" if args.listen else "--openai"
            sys.exit(f"fairstream replica: {option}: {where!r} is not HOST:PORT (port 0-65535; an IPv6 host in brackets, [::1]:7000)")
        host, port = parsed
        if not secret and not _loopback(host):
            logging.getLogger("fairstream.replica").warning(
                "listening on %s without a secret (%s is not set): anyone who reaches this address can use the "
                "replica", host, args.secret_env)
    elif not args.socket:
        sys.exit("fairstream replica: give --socket PATH, --listen HOST:PORT or --openai HOST:PORT")
    elif not os.path.isdir(os.path.dirname(os.path.abspath(args.socket))):
        sys.exit(f"fairstream replica: --socket: no directory {os.path.dirname(os.path.abspath(args.socket))!r} "
                 "to put the socket in")
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        _serve(args, runner, config, host, port, secret)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        # one line that says why, with the replica's name (the supervisor
        # only sees the exit status); the traceback follows it, unless the
        # cause is the replica's settings or address (a bad engine setting,
        # a port in use), which the line says in full
        import msgspec

        told = isinstance(e, (EngineError, msgspec.ValidationError, OSError))
        logging.getLogger("fairstream.replica").error("replica failed: %s: %s", type(e).__name__, e,
                                                      exc_info=not told)
        write_error_file(f"{type(e).__name__}: {e}")
        sys.exit(1)


def _serve(args: argparse.Namespace, runner, config: dict, host, port, secret: str) -> None:
    from replicas.server import serve

    if args.openai:
        from replicas.openai_server import serve_openai

        runner(
            serve_openai(
                args.engine,
                config,
                host or "127.0.0.1",
                port or 0,
                token_ids=not args.no_token_ids,
                stream_interval=args.stream_interval,
                api_key=secret,
                exit_with_parent=args.exit_with_parent,
            )
        )
        return
    runner(
        serve(
            args.engine,
            config,
            socket_path=args.socket,
            host=host,
            port=port or 0,
            secret=secret,
            exit_with_parent=args.exit_with_parent,
        )
    )


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):  # ("": the servers bind 127.0.0.1)
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="fairstream replica")
    add_arguments(p)
    run(p.parse_args(argv))
