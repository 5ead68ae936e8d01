"""The ``fairstream`` command: serve, replica, check-config, hash-key."""

from __future__ import annotations

import signal
import sys

# A SIGHUP (systemd's reload, ExecReload) while serve starts must not kill it
# with the default action (a death by SIGHUP counts as clean: Restart=on-failure
# would not restart it). So serve ignores it from here, as this process's own
# code begins (the console script and ``python -m router.cli`` import this
# module first; argparse, the commands' imports and the version's lookup took
# ~0.1 s before), until the tenant policy registry installs its reload
# handler, which then reads the file again (router/policy.py): a reload asked
# for while it started is not lost. (Only for serve: other commands, and a
# program that imports this module, keep the default.)
if sys.argv[1:2] == ["serve"]:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (already, unless main was given its argv: see the top)
    # (router.app and router.server import prometheus-client, which picks its
    # multiprocess mode when first imported: --workers sets that up first)
    from router.config import load_router_config
    from router.configfile import ConfigError
    from router.logs import setup_logging

    try:
        config, tenants = load_router_config(args.config)
        if args.tenants:
            tenants = Path(args.tenants)
        unset = _unset_secrets(config)
        if unset:
            print(f"fairstream serve: {', '.join(unset)} (a replica's secret_env in {args.config}) is not set or "
                  "empty in this environment", file=sys.stderr)
            return 1
        if args.workers > 1:
            from router.configfile import load_yaml
            from router.tenants import TenantsFile

            load_yaml(tenants, TenantsFile)  # fail now, not in every worker
            app = None
        else:
            from router.app import create_app

            app = create_app(config, tenants)
    except ConfigError as e:
        print("\n".join(e.errors), file=sys.stderr)
        return 1
    setup_logging(args.log_level, json=args.log_format == "json")
    for name in _unset_api_keys(config):
        import logging

        logging.getLogger("fairstream.router").warning(
            "%s (a url replica's api_key_env) is not set or empty: its upstream is called without an API key", name)
    host = args.host or config.host
    port = config.port if args.port is None else args.port
    if args.workers > 1:
        from router.workers import serve_workers

        log_args = ["--log-level", args.log_level, "--log-format", args.log_format]
        return serve_workers(config, tenants, host, port, args.workers, log_args)
    from router.server import Server

    server = Server(app, host=host, port=port, backlog=4096)
    try:
        server.run()
    except KeyboardInterrupt:  # (uvicorn raises Ctrl-C's signal again once it has shut down)
        return 130
    # (started with SIGINT ignored, as a non-interactive shell starts what it
    # puts in the background: uvicorn raises it again under SIG_IGN, to no effect)
    return 130 if server.first_signal == signal.SIGINT else 0


def _unset_secrets(config) -> list[str]:
    """The ``secret_env`` names of replicas reached by address that this
    environment leaves unset or empty: such a replica would refuse every
    connection, over and over, so ``serve`` refuses to start (a local one
    gets the same value as the router, whatever it is)."""
    return sorted({r.secret_env for r in config.replicas
                   if r.address is not None and r.secret_env and not os.environ.get(r.secret_env)})


def _unset_api_keys(config) -> list[str]:
    """The ``api_key_env`` names of ``url`` replicas that this environment
    leaves unset or empty (their upstreams get no ``Authorization``: a typo
    shows only as the upstream's 401)."""
    return sorted({r.api_key_env for r in config.replicas
                   if r.url is not None and r.api_key_env and not os.environ.get(r.api_key_env)})


def _check(args: argparse.Namespace) -> int:
    from router.config import RouterConfig, tenants_path
    from router.configfile import ConfigError, load_yaml
    from router.tenants import TenantsFile

    failed = False
    files = list(args.files)
    given = {os.path.realpath(f) for f in files}
    seen = set(given)  # (each file once, however it is spelled)
    tenants_given = False  # (a tenants file given stands for the one router.yaml names, as serve --tenants)
    routers = {os.path.realpath(f) for f in files if _told_kind(f) is RouterConfig}
    for path in files:  # (grows: the tenants file a router.yaml names, unless given too)
        named = os.path.realpath(path) not in given
        if named and tenants_given:
            print(f"{path}: note: not checked; the tenants file given stands for it (as with `serve --tenants`)",
                  file=sys.stderr)
            continue
        try:
            kind = TenantsFile if named else _known_kind(path)
            if kind is None:  # (then a syntax error or an empty file: say what it is checked as, and why)
                beside = bool(routers - {os.path.realpath(path)})
                kind = _config_kind(path, beside)
                print(f"{path}: note: no top-level key can be read to tell a router config from a tenants file; "
                      f"taken for {'the tenants file given with a router config' if beside else 'a router config'}",
                      file=sys.stderr)
            tenants_given = tenants_given or kind is TenantsFile
            loaded, _ = load_yaml(path, kind)
            print(f"{path}: ok ({'router' if kind is RouterConfig else 'tenants'} config)")
            if kind is RouterConfig:
                tenants = str(tenants_path(loaded, path))
                if os.path.realpath(tenants) not in seen:
                    seen.add(os.path.realpath(tenants))
                    files.append(tenants)  # (serve refuses to start without it, unless given --tenants)
            unset = _unset_secrets(loaded) if kind is RouterConfig else []
            if unset:  # (a note, not an error: the file may be checked where the secrets are not, e.g. in CI)
                print(f"{path}: note: {', '.join(unset)} (a replica's secret_env) is not set or empty in this "
                      "environment; `fairstream serve` refuses to start without it", file=sys.stderr)
            keyless = _unset_api_keys(loaded) if kind is RouterConfig else []
            if keyless:
                print(f"{path}: note: {', '.join(keyless)} (a url replica's api_key_env) is not set or empty in "
                      "this environment; its upstream is then called without an API key", file=sys.stderr)
        except ConfigError as e:
            failed = True
            print("\n".join(e.errors), file=sys.stderr)
    return 1 if failed else 0


def _config_kind(path: str, beside_router: bool = False) -> type:
    """Tenants file or router config, by its top-level keys (those read
    before a syntax error too: its loader reports the error either way; with
    none read, an error before the first key, those written at the start of
    a line). A file with none of either kind's own keys (empty, or broken
    before any) is told by its name, and else, given ``beside_router`` (a
    router config given with it, whose tenants file it then stands for), is
    the tenants file (check-config notes that it could not tell)."""
    from router.config import RouterConfig
    from router.tenants import TenantsFile

    return _known_kind(path) or (TenantsFile if beside_router else RouterConfig)


def _known_kind(path: str) -> type | None:
    """``_config_kind`` by the file's keys, else its name; None if neither tells."""
    return _told_kind(path) or _named_kind(path)


def _named_kind(path: str) -> type | None:
    """``_config_kind`` by the file's name ("tenant" or "router" in it); None if neither."""
    from router.config import RouterConfig
    from router.tenants import TenantsFile

    name = os.path.basename(path).lower()
    return TenantsFile if "tenant" in name else RouterConfig if "router" in name else None


def _told_kind(path: str) -> type | None:
    """``_config_kind`` by the file's top-level keys; None if they do not tell."""
    from router.config import RouterConfig
    from router.tenants import TenantsFile

    from router.yaml_syntax import unmarked

    try:
        with open(path, encoding="utf-8") as f:
            text = unmarked(f.read())  # (a byte order mark would hide line 1's key from _KEY_LINE)
    except (OSError, ValueError):  # (ValueError: not UTF-8)
        return None
    # (the top-level keys only, from the parser's events: building the whole
    # document is seconds of Python for a large file, recursion deeper than
    # the stack for deep nesting, and an exception for `!!float abc`, all of
    # which the loader itself reports)
    head = _keys_before_error(text)
    if not head:
        # (an error before the first key is read: the keys as written at the
        # start of a line, which a file broken at its first line still shows)
        written = set(_KEY_LINE.findall(text))
        router_keys, tenants_keys = set(RouterConfig.__struct_fields__), set(TenantsFile.__struct_fields__)
        if written & (router_keys - tenants_keys):
            return None if written & (tenants_keys - router_keys) else RouterConfig
        return TenantsFile if written & (tenants_keys - router_keys) else None
    # (router.yaml's ``tenants`` names a file and it must list replicas; a
    # tenants file's ``tenants`` is a mapping, or a mistake in one)
    if isinstance(head, dict) and "replicas" not in head and not isinstance(head.get("tenants"), str) and (
        "tenants" in head or "admin_keys" in head or "defaults" in head or "priority_classes" in head
    ):
        return TenantsFile
    return RouterConfig


_KEY_LINE = re.compile(r"^([A-Za-z_]\w*)[ \t]*:(?=\s|$)", re.M)  # (a key at the top level's column)


def _keys_before_error(text: str) -> dict[str, object]:
    """The top-level keys of a file, as far as the parser reads (before its
    error, if it has one), each with its value as far as it tells the kind
    of file: a scalar's text (None for a value that is not text, as null or
    a number, or not read), ``{}`` or ``[]`` for a mapping or a list begun."""
    import yaml

    from router.yaml_syntax import FAST_LOADER

    head: dict[str, object] = {}
    depth, in_mapping, is_key, key = 0, False, True, None
    last: str | None = None  # the key whose value, the last event read, spans lines
    # (PyYAML's own reader refuses the whole text for an unprintable
    # character anywhere, as it is built: the keys before one are read)
    unprintable = yaml.reader.Reader.NON_PRINTABLE.search(text)
    loader = FAST_LOADER(text[:unprintable.start()] if unprintable else text)
    try:
        while (event := loader.get_event()) is not None:
            last = None
            if isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
                continue
            if depth == 1 and in_mapping:
                if is_key:
                    key = event.value if isinstance(event, yaml.ScalarEvent) else None
                    if key is not None:
                        head[key] = None
                elif key is not None:
                    head[key] = _value_kind(event)
                    ran_on = isinstance(event, yaml.ScalarEvent) and event.start_mark.line < event.end_mark.line
                    last = key if ran_on else None
                is_key = not is_key
            if isinstance(event, yaml.CollectionStartEvent):
                in_mapping = in_mapping or (depth == 0 and isinstance(event, yaml.MappingStartEvent))
                depth += 1
    except yaml.YAMLError:
        # (the keys read so far are what there is; a scalar over several lines
        # just before the error may be a key without its ':' that ran on into
        # the next key: ``tenants:\n  gold\n    keys: ...``)
        if last is not None:
            head[last] = None
    finally:
        loader.dispose()
    return head


def _value_kind(event: object) -> object:
    """What ``_keys_before_error`` keeps of a value's first event."""
    import yaml

    if isinstance(event, yaml.MappingStartEvent):
        return {}
    if isinstance(event, yaml.SequenceStartEvent):
        return []
    if isinstance(event, yaml.ScalarEvent):
        tag = event.tag if event.tag not in (None, "!") else yaml.resolver.Resolver().resolve(
            yaml.ScalarNode, event.value, event.implicit)
        return event.value if tag == "tag:yaml.org,2002:str" else None
    return None


def _hash_key(args: argparse.Namespace) -> int:
    """Print the digest of a key given as an argument, piped on stdin (``-``
    or no argument) or typed at a prompt, so it need not sit in shell history
    or ``ps``."""
    from router.auth import hash_key, key_problem

    key = args.key
    if key == "-" or (key is None and not sys.stdin.isatty()):
        key = sys.stdin.read().strip()
    elif key is None:
        import getpass

        try:
            key = getpass.getpass("API key: ").strip()
        except EOFError:
            key = ""
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
    if not key.strip():
        print("fairstream hash-key: error: the key is empty", file=sys.stderr)
        return 2
    key = key.strip()  # (as the header arrives: spaces around a key never reach the router)
    if len(key.splitlines()) > 1:  # no header can carry it: a file of keys, not one key
        print("fairstream hash-key: error: the key spans several lines; hash one key at a time",
              file=sys.stderr)
        return 2
    problem = key_problem(key)  # (the router refuses such a key on every transport: no digest of it)
    if problem is not None:
        print(f"fairstream hash-key: error: {problem}", file=sys.stderr)
        return 2
    if not key.isascii():  # (the router takes it as UTF-8 or latin-1 bytes; some clients cannot send it)
        latin1 = all(ord(c) <= 0xFF for c in key)
        print("fairstream hash-key: note: the key is not ASCII: "
              + ("curl, requests, browsers' fetch, Node " if latin1 else "curl ")
              + "and the WebSocket's auth message can send it, but the openai SDK and httpx (given it as text)"
              + ("" if latin1 else ", requests, browsers' fetch and Node (only characters up to U+00FF)")
              + " cannot; see README, \"API keys\"", file=sys.stderr)
    print(hash_key(key))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fairstream")
    except PackageNotFoundError:  # a source tree that was never pip-installed
        return "unknown (not installed)"


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _port(text: str) -> int:
    n = _integer(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port (0-65535)")
    return n


def _at_least_one(text: str) -> int:
    n = _integer(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its commands' parsers, by name."""
    p = argparse.ArgumentParser(prog="fairstream", description="Multi-tenant streaming router for vLLM")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")

    about = "run the router"
    s = sub.add_parser("serve", help=about, description=about)
    s.add_argument("--config", default="configs/router.yaml", metavar="FILE", help="router config file (default: %(default)s)")
    s.add_argument("--tenants", metavar="FILE", help="tenant policy file (default: the one router.yaml names)")
    s.add_argument("--host", help="address to listen on (default: host in router.yaml)")
    s.add_argument("--port", type=_port, help="port to listen on, 0 for any free one (default: port in router.yaml)")
    s.add_argument("--workers", type=_at_least_one, default=1, metavar="N",
                   help="router processes sharing the port (needs Redis) (default: %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe level logged (default: %(default)s)")
    s.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="one JSON object per line, or plain text (default: %(default)s)")
    s.set_defaults(func=_serve)

    from replicas.cli import add_arguments, run

    about = "run one replica process (e.g. on a GPU host)"
    r = sub.add_parser("replica", help=about, description=about)
    add_arguments(r)
    r.set_defaults(func=lambda a: run(a) or 0)

    about = "validate router.yaml / tenants.yaml files"
    c = sub.add_parser("check-config", help=about, description=about)
    c.add_argument("files", nargs="+", metavar="FILE",
                   help="router or tenants config; which one is told by its top-level keys")
    c.set_defaults(func=_check)

    about = "print the SHA-256 digest of an API key for tenants.yaml"
    h = sub.add_parser("hash-key", help=about, description=about)
    h.add_argument("key", nargs="?", metavar="KEY",
                   help="the API key, or '-' to read it from stdin; without KEY it is read from stdin, "
                   "or asked for at a terminal (either keeps it out of shell history and ps)")
    h.set_defaults(func=_hash_key)
    return p, sub.choices


def main(argv: list[str] | None = None) -> None:
    p, commands = _parser()
    args = p.parse_args(argv)
    if args.cmd is None:
        p.error(f"a command is required: {', '.join(commands)}")
    try:
        code = args.func(args)
    except KeyboardInterrupt:  # (Ctrl-C before the command's own handling is up: while serve imports)
        code = 130
    sys.exit(code)


if __name__ == "__main__":  # python -m router.cli (as the fairstream command)
    main()
