"""Generate the configuration reference (docs/configuration.md) from the schemas.

Each config struct documents its fields with a string right after the field
(an attribute docstring). This module reads them with ``ast`` from the source
of the modules that define the schemas, pairs them with the types and
defaults msgspec knows, and writes one table per struct. A field whose
default is ``None`` shows "inherited" in the tenants.yaml tables (a tenant
takes the field from ``defaults``, ``defaults`` from the built-in values);
elsewhere its docstring ends with ``Unset: ...``, what leaving it out means,
and that text goes in the default column. A test fails when
docs/configuration.md differs from what this produces, so the reference
cannot drift from the code: ``python -m router.configdoc > docs/configuration.md``.
"""

from __future__ import annotations

import ast
import inspect
import sys

import msgspec

__all__ = ["render"]


def _field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, msgspec.Struct)) or klass is msgspec.Struct:
            continue
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(t: object) -> str:
    s = getattr(t, "__name__", None) if isinstance(t, type) else None
    text = s or str(t)
    return text.replace("typing.", "").replace("NoneType", "None")


_UNSET = "Unset: "


def _split_unset(doc: str) -> tuple[str, str]:
    """``doc`` without its trailing ``Unset: ...`` sentence, and that sentence's text."""
    head, sep, unset = doc.partition(_UNSET)
    return (head.rstrip(), unset.strip()) if sep else (doc, "")


def _default(info: msgspec.inspect.Field, unset: str | None) -> str:
    """``unset``: what a ``None`` default means (None: inherited)."""
    if info.default is not msgspec.NODEFAULT:
        d = info.default
        if isinstance(d, msgspec.Struct):
            return "(see below)"
        if d is None:
            return "inherited" if unset is None else "unset: " + unset.rstrip(".")
        return "`" + msgspec.json.encode(d).decode() + "`"
    if info.default_factory is not msgspec.NODEFAULT:
        d = info.default_factory()
        if isinstance(d, msgspec.Struct):
            return "(see below)"
        return "`" + msgspec.json.encode(d).decode() + "`"
    return "required"


def _table(title: str, cls: type, intro: str = "", *, inherits: bool = False) -> str:
    """One struct's table. ``inherits``: a ``None`` default means the field is
    inherited (tenants.yaml); else the field's docstring must say what it
    means, in a last sentence ``Unset: ...``."""
    docs = _field_docs(cls)
    annotations = {}
    for klass in reversed(cls.__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    lines = [f"### {title}", ""]
    if intro:
        lines += [intro, ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in msgspec.structs.fields(cls):
        typ = _type_name(annotations.get(f.name, f.type)).replace("|", "\\|")
        doc = docs.get(f.name, "")
        unset = None
        if f.default is None and not inherits:
            doc, unset = _split_unset(doc)
            if not unset:
                raise ValueError(f"{cls.__name__}.{f.name}: a None default needs a last sentence 'Unset: ...'")
        default = _default(f, unset)
        lines.append(f"| `{f.encode_name}` | {typ} | {default} | {doc} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    from policies.batching import AimdSettings
    from replicas.sim import SimConfig
    from replicas.spec import ReplicaSpec
    from replicas.vllm_engine import VllmEngineConfig
    from router.config import RouterConfig
    from router.cors import CorsSettings
    from router.scheduler_settings import SchedulerSettings
    from router.state import StateConfig
    from router.tenants import BUILTIN, Defaults, Limits, TenantSpec, TenantsFile, Timeouts

    builtin = msgspec.to_builtins(BUILTIN)
    parts = [
        "# Configuration reference",
        "",
        "Generated from the schemas by `python -m router.configdoc > docs/configuration.md`;",
        "a test keeps this file in sync. Both files are strict: an unknown key, a wrong type or",
        "a bad value fails with `file:line: key: reason` (`fairstream check-config FILE`), every",
        "error found in one go, up to 20 (README: Configuration, errors).",
        "",
        "## tenants.yaml",
        "",
        "Reloads live on file change, on SIGHUP and on `POST /admin/reload`; a file that fails",
        "validation keeps the previous policy in force (a reload that failed for a reason of the",
        "moment, such as the open-file limit, is tried again on its own: README, Known limitations,",
        "\"A reload of thousands of tenants\"). A tenant inherits every field it leaves",
        "out from `defaults`, and `defaults` from the built-in values (field by field, also inside",
        "`limits` and `timeouts`). Every limit and timeout takes 0 for \"no limit\" (not \"none",
        "allowed\"), as each field says; `queue_depth: 0` is the exception (no request may wait).",
        "",
        "Numbers: the files are read as YAML 1.1 (PyYAML), where `1e3` (no dot, no sign in the",
        "exponent) is text, not a number: write `1000` (or, where a float is taken, `1.0e+3`; an integer",
        "field takes no exponent). A number in quotes is",
        "text too. A field that wants a number says so when it gets one written as text.",
        "",
        _table("Top level", TenantsFile, inherits=True),
        _table("tenants.NAME", TenantSpec, "Any field of `defaults` plus `keys`.", inherits=True),
        _table("defaults", Defaults, inherits=True),
        _table("limits", Limits, inherits=True),
        _table("timeouts", Timeouts, inherits=True),
        "Built-in values (what applies when neither the tenant nor `defaults` sets a field):",
        "",
        "```json",
        msgspec.json.format(msgspec.json.encode(builtin), indent=2).decode(),
        "```",
        "",
        "## router.yaml",
        "",
        _table("Top level", RouterConfig),
        _table("replicas[]", ReplicaSpec),
        _table("state", StateConfig),
        _table("scheduler", SchedulerSettings),
        _table("batching", AimdSettings),
        _table("cors", CorsSettings),
        _table("replicas[].config for engine: sim", SimConfig),
        _table("replicas[].config for engine: vllm", VllmEngineConfig),
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())
