"""The ``fairstream`` command: serve, replica, check-config, hash-key."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    from router.app import create_app
    from router.config import load_router_config
    from router.configfile import ConfigError
    from router.logs import setup_logging
    from router.server import Server

    try:
        config, tenants = load_router_config(args.config)
        if args.tenants:
            tenants = Path(args.tenants)
        if args.workers > 1:
            from router.configfile import load_yaml
            from router.tenants import TenantsFile

            load_yaml(tenants, TenantsFile)  # fail now, not in every worker
            app = None
        else:
            app = create_app(config, tenants)
    except ConfigError as e:
        print("\n".join(e.errors), file=sys.stderr)
        return 1
    setup_logging(args.log_level, json=args.log_format == "json")
    host = args.host or config.host
    port = args.port or config.port
    if args.workers > 1:
        from router.workers import serve_workers

        log_args = ["--log-level", args.log_level, "--log-format", args.log_format]
        return serve_workers(config, tenants, host, port, args.workers, log_args)
    Server(app, host=host, port=port, backlog=4096).run()
    return 0


def _check(args: argparse.Namespace) -> int:
    from router.config import RouterConfig
    from router.configfile import ConfigError, load_yaml

    failed = False
    for path in args.files:
        try:
            kind = _config_kind(path)
            load_yaml(path, kind)
            print(f"{path}: ok ({'router' if kind is RouterConfig else 'tenants'} config)")
        except ConfigError as e:
            failed = True
            print("\n".join(e.errors), file=sys.stderr)
    return 1 if failed else 0


def _config_kind(path: str) -> type:
    """Tenants file or router config, by its top-level keys (a file that does
    not parse is handed to the router schema, whose loader reports the error)."""
    import yaml

    from router.config import RouterConfig
    from router.tenants import TenantsFile

    try:
        with open(path, encoding="utf-8") as f:
            head = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return RouterConfig
    if isinstance(head, dict) and (
        isinstance(head.get("tenants"), dict) or "admin_keys" in head or "defaults" in head
    ):
        return TenantsFile
    return RouterConfig


def _hash_key(args: argparse.Namespace) -> int:
    from router.auth import hash_key

    print(hash_key(args.key))
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="fairstream", description="Multi-tenant streaming router for vLLM")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the router")
    s.add_argument("--config", default="configs/router.yaml")
    s.add_argument("--tenants", help="tenant policy file (default: from router.yaml)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--workers", type=int, default=1, help="router processes sharing the port (needs Redis)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--log-format", default="json", choices=["json", "text"])
    s.set_defaults(func=_serve)

    from replicas.cli import add_arguments, run

    r = sub.add_parser("replica", help="run one replica process (e.g. on a GPU host)")
    add_arguments(r)
    r.set_defaults(func=lambda a: run(a) or 0)

    c = sub.add_parser("check-config", help="validate router.yaml / tenants.yaml files")
    c.add_argument("files", nargs="+")
    c.set_defaults(func=_check)

    h = sub.add_parser("hash-key", help="print the SHA-256 digest of an API key for tenants.yaml")
    h.add_argument("key")
    h.set_defaults(func=_hash_key)

    args = p.parse_args(argv)
    sys.exit(args.func(args))
