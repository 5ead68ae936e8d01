"""Strict YAML loading into msgspec structs, with ``file:line: key: reason`` errors.

PyYAML's node tree keeps a line for every key and value; msgspec's validation
errors carry a JSON path (``$.tenants.gold.limits.rpm``). ``load_yaml`` maps the
one onto the other so every error names the file, the line and the key.

A bad file reports every error found in one go, in file order, up to
``MAX_ERRORS`` lines (then one line counts the rest): each key defined twice,
every schema error (``router.schema_errors``), and the struct's own checks
(``validate``) over the parts whose schema is right, where the struct says
those checks can do without the failed parts (``separable``).
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from router.schema_errors import KeyPath, entries_of, schema_errors
from router.yaml_syntax import FAST_LOADER, cut, reader_error, syntax_error

__all__ = ["ConfigError", "load_yaml", "read_text", "Located", "MAX_ERRORS"]

T = TypeVar("T")

MAX_VALUES = 1_000_000  # values in one file, YAML aliases expanded
MAX_ERRORS = 20  # errors listed for one file; one more line counts the rest


class ConfigError(ValueError):
    """A config file is invalid; ``errors`` holds one ``file:line: key: reason`` per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("\n".join(errors))


class Located:
    """Line numbers of every path in a YAML document."""

    def __init__(self, path: str, root: yaml.Node | None) -> None:
        self.path = path
        self.lines: dict[tuple[Any, ...], int] = {}
        self.key_lines: dict[tuple[Any, ...], int] = {}
        self.duplicates: list[str] = []
        self.duplicated: list[KeyPath] = []  # the paths of ``duplicates``
        self._left = MAX_VALUES
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: yaml.Node, at: tuple[Any, ...]) -> None:
        self._left -= 1
        if self._left < 0:
            # (aliases expand: a few hundred bytes of nested ones would be billions of values)
            raise ConfigError([f"{self.path}:{node.start_mark.line + 1}: (file): more than {MAX_VALUES} values "
                               "once YAML aliases are expanded; write the values out or use fewer aliases"])
        self.lines[at] = node.start_mark.line + 1
        if _too_long(node):
            # (Python reads no int of more digits: a ValueError, with no line, when the data is built)
            raise ConfigError([self.error(at, f"a number of {_TOO_LONG}")])
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value
                line = k.start_mark.line + 1
                if not isinstance(k, yaml.ScalarNode):  # (`? weight: 1`, `[a, b]: 1`: no name, and unhashable)
                    raise ConfigError([f"{self.path}:{line}: {_dotted(at)}: a key that is a mapping or a list is "
                                       "not allowed (a '? ' before it, or brackets): a key is a name"])
                if _too_long(k):  # (a key's name is written out in messages: a hex one is read, not written)
                    raise ConfigError([f"{self.path}:{line}: {_dotted(at)}: a key that is a number of {_TOO_LONG}"])
                first = self.key_lines.get(at + (key,))
                if first is not None:
                    # YAML would silently keep the last one (and drop, say, a tenant's keys)
                    self.duplicates.append(f"{self.path}:{line}: {_dotted(at + (key,))}: defined twice "
                                           f"(first at line {first})")
                    self.duplicated.append(at + (key,))
                    continue
                self.key_lines[at + (key,)] = line
                self._walk(v, at + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, at + (i,))

    def line(self, at: tuple[Any, ...]) -> int:
        while at:
            if at in self.key_lines:
                return self.key_lines[at]
            if at in self.lines:
                return self.lines[at]
            # (a key YAML typed, `123:` or `true:`, is looked up as written)
            named = at[:-1] + (str(at[-1]),)
            if not isinstance(at[-1], str) and named in self.key_lines:
                return self.key_lines[named]
            at = at[:-1]
        return self.lines.get((), 1)

    def error(self, at: tuple[Any, ...], reason: str) -> str:
        return f"{self.path}:{self.line(at)}: {_dotted(at)}: {reason}"

    def name(self, at: tuple[Any, ...]) -> str:
        """``at`` as a message names it (``admin_keys.1``)."""
        return _dotted(at)


_INT = "tag:yaml.org,2002:int"
_TOO_LONG = "more than 4,300 digits; Python reads or writes out none that long"
_DIGITS_LIMIT = 10 ** 4300


def _too_long(node: yaml.Node) -> bool:
    """An int node of more than 4,300 digits: Python will not read it from
    decimal text, nor write it out, as a message naming it must (one written
    in hex, of 3,600 characters, is read)."""
    # (hex, the densest form, needs over 3,500 characters for that many digits)
    if node.tag != _INT or not isinstance(node.value, str) or len(node.value) <= 3500:
        return False
    try:
        return abs(yaml.constructor.SafeConstructor().construct_yaml_int(node)) >= _DIGITS_LIMIT
    except ValueError:
        return True


def _dotted(at: KeyPath) -> str:
    return ".".join(str(p) for p in at) or "(top level)"


class _SetAside(Located):
    """``Located`` for ``validate()`` run on a document whose failed parts
    were set aside: an item of a list that lost items is numbered as in the
    file, and what ``validate()`` says about a part set aside, or about what
    holds one ("at least one tenant is needed" once the only tenant was set
    aside), goes into ``left_out``."""

    def __init__(self, located: Located, numbering: dict[Any, list[int]], aside: list[KeyPath]) -> None:
        self.path, self.lines, self.key_lines = located.path, located.lines, located.key_lines
        self.duplicates, self.duplicated = located.duplicates, located.duplicated
        self._numbering = numbering  # list field -> the file's index of each item kept
        self._aside = aside
        self.left_out: set[str] = set()

    def _in_file(self, at: KeyPath) -> KeyPath:
        kept = self._numbering.get(at[0]) if len(at) > 1 and isinstance(at[1], int) else None
        return (at[0], kept[at[1]]) + at[2:] if kept is not None else at

    def line(self, at: KeyPath) -> int:
        return Located.line(self, self._in_file(at))

    def name(self, at: KeyPath) -> str:
        return _dotted(self._in_file(at))

    def error(self, at: KeyPath, reason: str) -> str:
        at = self._in_file(at)
        text = f"{self.path}:{Located.line(self, at)}: {_dotted(at)}: {reason}"
        if any(at[: len(a)] == a or a[: len(at)] == at for a in self._aside):
            self.left_out.add(text)
        return text


def _set_aside(data: Any, type_: Any, failed: list[KeyPath], located: Located) -> tuple[Any, _SetAside] | None:
    """The document without its ``failed`` parts, as ``type_``, for the
    struct's own checks; None when a failed part is one those checks cannot
    do without.

    ``type_.separable`` names the top-level fields that ``validate()`` checks
    each on its own (a dict's or list's entries each on its own, but for
    duplicates across them): a failed entry of one is left out, a failed
    value of one takes its default. An unknown top-level key is dropped when
    every field is separable (else it may be a misspelt one the checks need).
    Anything else failed (the top level, a field that is not separable, a
    required one) leaves nothing sound to check.
    """
    separable = getattr(type_, "separable", frozenset())
    if not separable or not isinstance(data, dict):
        return None
    fields = {f.encode_name: f for f in msgspec.structs.fields(type_)}
    doc = dict(data)
    entries: dict[Any, set[Any]] = {}
    aside: list[KeyPath] = []
    for at in failed:
        key = at[0] if at else None
        if key is None or (key in fields and key not in separable):
            return None
        if key not in fields:
            if not set(fields) <= separable:
                return None
            doc.pop(key, None)
        elif len(at) > 1 and entries_of(fields[key].type, data[key]):
            entries.setdefault(key, set()).add(at[1])
        elif fields[key].required:
            return None
        else:
            doc.pop(key, None)
            aside.append((key,))
    numbering: dict[Any, list[int]] = {}
    for key, bad in entries.items():
        if key not in doc:
            continue  # (its whole value was set aside too)
        aside += [(key, entry) for entry in bad]
        value = data[key]
        if isinstance(value, dict):
            doc[key] = {k: v for k, v in value.items() if k not in bad}
        else:
            numbering[key] = [i for i in range(len(value)) if i not in bad]
            doc[key] = [value[i] for i in numbering[key]]
    try:
        return msgspec.convert(doc, type_, strict=True), _SetAside(located, numbering, aside)
    except msgspec.ValidationError:
        return None  # (what failed was not all set aside: check nothing rather than guess)


def _in_file_order(name: str, errors: list[str]) -> list[str]:
    """``errors`` by line (a stable sort: one line's errors keep their
    order), at most ``MAX_ERRORS`` of them and a line that counts the rest."""
    prefix = re.compile(rf"{re.escape(name)}:(\d+):")

    def line(error: str) -> int:
        m = prefix.match(error)
        return int(m.group(1)) if m else 0

    errors = sorted(errors, key=line)
    if len(errors) <= MAX_ERRORS:
        return errors
    rest = len(errors) - MAX_ERRORS
    return errors[:MAX_ERRORS] + [f"{name}:{line(errors[MAX_ERRORS])}: (more): {rest} more error"
                                  f"{'s' if rest > 1 else ''} from this line on (only the first {MAX_ERRORS} "
                                  "are listed)"]


def read_text(path: str | Path) -> str:
    """The file's text; ``ConfigError`` if it cannot be read or is not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError([f"{path}:1: (file): cannot read: {e.strerror or e}"]) from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError([f"{path}:{line}: (file): not UTF-8 text (byte {e.start}: {e.reason})"]) from e


def load_yaml(path: str | Path, type_: type[T], text: str | None = None) -> tuple[T, Located]:
    """``_load_yaml``, with a file nested too deeply for the parser's and
    the checks' recursion (libyaml refuses 1,000 levels, Python's stack ends
    a little before) refused as one error, like the libyaml limit, not a
    ``RecursionError`` (a 500 on ``POST /admin/reload``, a reload that
    failed without saying so)."""
    try:
        return _load_yaml(path, type_, text)
    except RecursionError:
        raise ConfigError([f"{path}:1: (syntax): nested too deeply to read; "
                           "write the values with fewer levels"]) from None


def _load_yaml(path: str | Path, type_: type[T], text: str | None = None) -> tuple[T, Located]:
    """Parse and validate ``path`` (or ``text`` reported as ``path``) as ``type_``.

    Raises ``ConfigError`` with every located message found (see the
    module's docstring). Structs may define ``validate(located) -> list[str]``
    for checks across fields, and ``separable`` (a ClassVar: the top-level
    fields those checks take each on its own) to have them run when other
    parts of the file fail the schema.
    """
    name = str(path)
    if text is None:
        text = read_text(path)
    try:
        # one parse: the node graph (for line numbers), then the data built from it
        loader = FAST_LOADER(text)
        try:
            root = loader.get_single_node()
            # located first: building the data rewrites merge keys (<<:) in the
            # graph, and a graph of too many values must be refused unbuilt
            located = Located(name, root)
            data = _construct(name, loader, root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        raise ConfigError([syntax_error(name, text, e)]) from e
    except yaml.reader.ReaderError as e:
        raise ConfigError([reader_error(name, text, e)]) from e
    except yaml.YAMLError as e:
        raise ConfigError([f"{name}:1: (syntax): {e}"]) from e
    if data is None:
        data = {}
    errors = list(located.duplicates)
    failed: list[KeyPath] = list(located.duplicated)
    try:
        value = msgspec.convert(data, type_, strict=True)
    except msgspec.ValidationError:
        value = None
        for at, reason in schema_errors(data, type_):
            # (in a key defined twice the data holds the last value, the lines the first one's)
            if not any(at[: len(d)] == d for d in located.duplicated):
                errors.append(located.error(at, _number_hint(data, at, reason)))
                failed.append(at)
    if not failed:
        errors += _own_checks(value, located)
    else:
        partial = _set_aside(data, type_, failed, located)
        if partial is not None:
            errors += _own_checks(*partial)
    if errors:
        raise ConfigError(_in_file_order(name, errors))
    return value, located


# what PyYAML's constructor raises for a scalar that its tag (written, or
# taken from how it is written) does not fit, as ``!!float abc``, ``!!bool
# abc``, ``!!timestamp abc`` or ``2024-13-01`` (an empty ``!!int`` or
# ``!!float``: IndexError): not a YAMLError, and no line
_UNBUILT = (ValueError, KeyError, AttributeError, TypeError, OverflowError, IndexError)


def _construct(name: str, loader: Any, root: yaml.Node) -> Any:
    try:
        return loader.construct_document(root)
    except _UNBUILT as e:
        raise ConfigError([_unbuilt(name, root, e)]) from None


def _unbuilt(name: str, root: yaml.Node, error: Exception) -> str:
    """The error for the first scalar, in file order, that the constructor
    cannot build on its own; if none (the failure was elsewhere), the
    constructor's error at line 1."""
    constructor = yaml.constructor.SafeConstructor()
    stack: list[tuple[yaml.Node, KeyPath]] = [(root, ())]
    seen: set[int] = set()  # (aliases: a node is met again, or inside itself)
    while stack:
        node, at = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in reversed(node.value):
                stack += [(v, at + (k.value,)), (k, at)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(v, at + (i,)) for i, v in reversed(list(enumerate(node.value)))]
        elif isinstance(node, yaml.ScalarNode):
            try:
                constructor.construct_object(node)
            except _UNBUILT as e:
                kind = node.tag.replace("tag:yaml.org,2002:", "!!")
                why = f" ({cut(str(e))})" if isinstance(e, ValueError) and str(e) else ""
                return (f"{name}:{node.start_mark.line + 1}: {_dotted(at)}: `{cut(node.value)}` cannot be read as "
                        f"{kind}{why}: its tag, or if it has none how it is written (2024-13-01 as a date), "
                        "makes it one; write a valid one, or put it in quotes to make it text")
            except yaml.YAMLError:
                continue
    return f"{name}:1: (file): a value cannot be read: {type(error).__name__}: {cut(str(error))}"


# a number as text: quoted, or in a form YAML 1.1 (PyYAML) does not read as
# one (``1e3``, ``1.5e3``: it wants a dot and a signed exponent, ``1.5e+3``)
_NUMBER_TEXT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _number_hint(data: Any, at: KeyPath, reason: str) -> str:
    """``reason``, and when a number was expected and the value is a number
    written as text, how to write it."""
    if not (reason.startswith("Expected `") and reason.endswith(", got `str`")
            and ("int" in reason or "float" in reason)):
        return reason
    value = data
    try:
        for part in at:
            value = value[part]
    except (KeyError, IndexError, TypeError):
        return reason
    if not (isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip())):
        return reason
    try:
        quoted = isinstance(yaml.safe_load(value), (int, float))
    except ValueError:  # (an int of more than 4,300 digits: Python will not read it)
        quoted = False
    shown = cut(value)
    if quoted:
        return f"{reason}: `{shown}` is in quotes, which make it text; write it without them"
    plain = _plain(value.strip())
    if "float" not in reason.split(", got")[0]:  # (an integer field: 1.0e+3 is a float, which it refuses too)
        told = f"{reason}: `{shown}` is text in YAML 1.1, which this reader follows: this field takes a whole number"
        whole = plain is not None and Decimal(plain) == Decimal(plain).to_integral_value()
        return f"{told}: write it as {int(Decimal(plain))}" if whole else told
    told = (f"{reason}: `{shown}` is text in YAML 1.1, which this reader follows (a number with an exponent "
            "needs a dot and a signed exponent there, as in 1.0e+3)")
    if plain is not None:
        return f"{told}; write it as a plain number: {plain}"
    mantissa, _, exponent = value.strip().lower().partition("e")
    dotted = (mantissa if "." in mantissa else mantissa + ".0") + "e" + (
        exponent if exponent[:1] in ("+", "-") else "+" + exponent)
    return f"{told}; it is too long to write out: write it as {cut(dotted)}"


def _plain(number: str) -> str | None:
    """``number`` written out without an exponent, when that is short: not
    for ``1e100000000`` (100 MB of zeros) or an exponent Decimal refuses."""
    try:
        value = Decimal(number)
    except ArithmeticError:  # (decimal.InvalidOperation: an exponent past Decimal's range)
        return None
    exponent = value.as_tuple().exponent
    if not isinstance(exponent, int) or abs(exponent) > 30:
        return None
    plain = format(value, "f")
    return plain if len(plain) <= 60 else None


def _own_checks(value: Any, located: Located) -> list[str]:
    """What the struct's ``validate(located)`` finds, less what it says about
    parts set aside."""
    check = getattr(value, "validate", None)
    if check is None:
        return []
    found: list[str] = check(located)
    if isinstance(located, _SetAside):
        found = [e for e in found if e not in located.left_out]
    return found
