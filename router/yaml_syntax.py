"""Where a YAML syntax error's mistake is, and what it most likely is.

The parser stops where the text can no longer be read, which may be lines
past the mistake, and says what it could not do there ("mapping values are
not allowed"), not what was written wrong (a key without its ':', a list
item without its '- ', a line indented too deep). ``syntax_error`` turns its
error into ``file:line: (syntax): reason`` at the mistake's line, reading
the text again with PyYAML's own scanner and parser where libyaml's error
does not say enough.
"""

from __future__ import annotations

import re

import yaml

__all__ = ["syntax_error", "reader_error", "unmarked", "cut", "FAST_LOADER"]


def reader_error(name: str, text: str, e: yaml.reader.ReaderError) -> str:
    """``file:line: (syntax): reason`` for a character YAML does not allow,
    at its line and column, naming it. The reader's error gives an offset in
    the whole text: bytes of UTF-8 from libyaml (its encoding ``'?'``),
    characters from PyYAML's own reader (``'unicode'``: a PyYAML without
    libyaml); either counts a byte order mark, which columns do not."""
    at = e.position
    if e.encoding == "?":
        at = len(text.encode("utf-8", "surrogatepass")[:at].decode("utf-8", "ignore"))
    bare = unmarked(text)  # (the offset counts a byte order mark, the columns do not)
    text, at = bare, at - (len(text) - len(bare))
    if not (0 <= at < len(text)):
        return f"{name}:1: (syntax): {e.reason} in YAML"
    code = e.character if isinstance(e.character, int) else ord(e.character)
    breaks = list(_BREAK.finditer(text, 0, at))
    line, column = len(breaks) + 1, at - (breaks[-1].end() if breaks else 0) + 1
    return f"{name}:{line}: (syntax): character U+{code:04X} at column {column}: {e.reason} in YAML; remove it"


def unmarked(text: str) -> str:
    """``text`` without the byte order mark it may begin with: YAML's readers
    drop it, so their marks' columns on line 1 do not count it (nor should
    a diagnosis that reads the text's lines, or its keys)."""
    return text[1:] if text.startswith("\ufeff") else text


_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")  # (the line breaks YAML counts lines by)


def syntax_error(name: str, text: str, e: yaml.MarkedYAMLError) -> str:
    """``file:line: (syntax): reason`` for a parser error. The parser stops
    where the text can no longer be read, which may be far past the mistake:
    an unclosed quote is found at the end of the file. Its context (the token
    or structure it was reading, and where that began) names the mistake's
    line, so a token that began on an earlier line (a quoted scalar) is
    reported at that line, and a structure (a ``[`` or ``{`` left open) at
    the stopping line with the line it began on. A key without its ':' reads
    as plain text that runs on into the lines after it (``_run_on``)."""
    mark, context = e.problem_mark, e.context_mark
    text = unmarked(text)  # (the marks' lines and columns are the same without it)
    line = (mark.line + 1) if mark else 1
    problem = str(e.problem or e)
    lines = text.splitlines()
    if mark and mark.line < len(lines) and "\t" in lines[mark.line][:mark.column + 1]:
        problem += " (a tab: YAML indents with spaces)"  # (what the parser says does not name it)
    if mark and not e.context and problem.startswith("mapping values are not allowed"):
        run_on = _run_on(text, mark)
        if run_on is not None:
            start, reading = run_on
            if reading == "value":
                return (f"{name}:{line}: (syntax): {problem} (the value {_quoted(lines, start)} from line "
                        f"{start.line + 1} runs on as plain text into this line: a line indented deeper than its "
                        "key continues the value)")
            said = _missing_colon(name, lines, start, f"runs on as plain text into line {line}, where the parser "
                                  f"stopped ({problem})")
            if reading == "key or value":
                said += (f"; or, if it is the value of the key above it, line {line} is indented deeper than that "
                         "key, as if under it")
            return said
    ended = _key_before_comment(text, lines, mark) if mark else None
    if ended is not None:
        return _missing_colon(name, lines, ended, f"(the parser found no ':' after it: {problem} at line {line})")
    if not (mark and context and e.context and context.line < mark.line):
        return f"{name}:{line}: (syntax): {problem}"
    if e.context == "while scanning a simple key":  # (a key at its block's indent, and no ':' by the line's end)
        return _unfinished_key(name, text, lines, context, line, problem)
    began = context.line + 1
    if e.context.startswith("while scanning"):  # (one token: the mistake is where it began)
        return f"{name}:{began}: (syntax): {e.context} from this line: {problem} at line {line}"
    return f"{name}:{line}: (syntax): {problem} ({e.context} from line {began})"


def _missing_colon(name: str, lines: list[str], start: yaml.Mark, then: str) -> str:
    quoted = _quoted(lines, start)
    return f"{name}:{start.line + 1}: (syntax): a ':' is missing after a key on this line: {quoted} {then}"


def _unfinished_key(name: str, text: str, lines: list[str], start: yaml.Mark, line: int, problem: str) -> str:
    """What a plain scalar at ``start`` that the parser took for a key, and
    found no ':' after, most likely is: in a block list, an item without its
    '- '; in a block mapping, a key without its ':', which runs on into the
    next line only if that line is indented deeper (else nothing ran on:
    the file's last line, or a key before a less indented one).

    The scalar is in the innermost collection open that does not begin right
    of it: the parser stops before it reads the end of a list the scalar is
    left of (the scanner raises with that end still queued), so such a list
    still looks open. A list not indented under its key (``keys:\n- a``)
    has its '-' in its mapping's column: a scalar there with lines indented
    deeper under it is the mapping's next key, not an item."""
    open_ = _open_collections(text, line - 1)
    if not open_ or open_[-1].flow_style:
        return (f"{name}:{start.line + 1}: (syntax): while scanning a simple key from this line: {problem} "
                f"at line {line}")
    while len(open_) > 1 and open_[-1].start_mark.column > start.column:
        open_.pop()
    at = next((i for i in range(start.line + 1, len(lines)) if lines[i].strip()[:1] not in ("", "#")), len(lines))
    after = lines[at] if at < len(lines) else ""
    deeper = bool(after) and len(after) - len(after.lstrip(" ")) > start.column
    inner = open_[-1]
    if isinstance(inner, yaml.SequenceStartEvent):
        column = inner.start_mark.column
        indentless = (len(open_) > 1 and isinstance(open_[-2], yaml.MappingStartEvent)
                      and open_[-2].start_mark.column == column)
        if not (indentless and deeper and start.column == column):
            return (f"{name}:{start.line + 1}: (syntax): an item of the list may be missing its '- ': "
                    f"{_quoted(lines, start)} on this line is read as a key, and no ':' follows ({problem})")
    if deeper and not _commented(lines, start, at):
        return _missing_colon(name, lines, start, f"runs on as plain text into line {line}, where the parser "
                              f"stopped ({problem})")
    return _missing_colon(name, lines, start, f"(the parser found no ':' after it: {problem})")


def _commented(lines: list[str], start: yaml.Mark, stop: int) -> bool:
    """Whether a comment follows the plain scalar at ``start`` before line
    ``stop`` (0-based): a comment ends a plain scalar, which then does not
    run on into the lines after it."""
    return bool(_COMMENT.search(lines[start.line], start.column)) or any(
        t.lstrip().startswith("#") for t in lines[start.line + 1:stop])


def _key_before_comment(text: str, lines: list[str], mark: yaml.Mark) -> yaml.Mark | None:
    """Where a key written without its ':' begins, when a comment ended it
    (on its line, or a comment line after it) before the lines under it: the
    key is then read as a scalar on a line of its own (the value of the key
    above it, or the whole document), and the parser stops at the next line
    read, which is indented deeper than it or, at the top level, is more of
    the document. None if the parser did not stop so."""
    if mark.line >= len(lines):
        return None
    event, depth = _last_event(text, mark.line)
    if not isinstance(event, yaml.ScalarEvent) or event.style not in (None, ""):
        return None
    start, end = event.start_mark, event.end_mark
    if not (start.line == end.line < mark.line and lines[start.line][:start.column].strip(" ") == ""):
        return None
    rest = lines[start.line][end.column:].strip()
    if rest[:1] not in ("", "#") or not _commented(lines, start, mark.line):
        return None
    if any(t.strip()[:1] not in ("", "#") for t in lines[start.line + 1:mark.line]):
        return None
    indent = len(lines[mark.line]) - len(lines[mark.line].lstrip(" "))
    return start if indent > start.column or depth == 0 else None


def _quoted(lines: list[str], start: yaml.Mark) -> str:
    """The text from ``start`` to the end of its line, in backquotes (cut short)."""
    text = lines[start.line][start.column:].strip() if start.line < len(lines) else ""
    if text[:1] not in ("'", '"'):  # (in a plain scalar, " #" begins a comment)
        text = _COMMENT.split(text, 1)[0]
    return f"`{cut(text)}`"


_COMMENT = re.compile(r"\s+#")


def _through_line(text: str, line: int) -> str:
    """``text`` up to the end of line ``line`` (0-based) at least: the part
    a re-read needs to reach an error on that line, and no more (PyYAML's
    pure reader refuses the whole text for an unprintable character
    anywhere, where libyaml stopped at the error first)."""
    end = -1
    for _ in range(line + 1):
        end = text.find("\n", end + 1)
        if end < 0:
            return text
    return text[:end + 1]


# libyaml's parser, with the safe constructor, when PyYAML has it: about 10x
# faster than PyYAML's own, for the loader (``router.configfile``), the events
# up to an error in a large file (the error being explained is libyaml's when
# it is there) and check-config's look at a file's keys
FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _open_collections(text: str, stop: int) -> list[yaml.CollectionStartEvent]:
    """The collections open, outermost first, where the parser stops, at
    line ``stop`` (0-based)."""
    return _read_to(text, stop)[0]


def _last_event(text: str, stop: int) -> tuple[yaml.Event | None, int]:
    """The last event the parser reads before it stops, at line ``stop``
    (0-based), and how many collections are open around it."""
    open_, last = _read_to(text, stop)
    return last, len(open_)


def _read_to(text: str, stop: int) -> tuple[list[yaml.CollectionStartEvent], yaml.Event | None]:
    """The collections open, outermost first, and the last event read,
    where the parser stops, at line ``stop`` (0-based)."""
    open_: list[yaml.CollectionStartEvent] = []
    last = None
    try:
        loader = FAST_LOADER(_through_line(text, stop))
        try:
            while (event := loader.get_event()) is not None:
                if not isinstance(event, yaml.DocumentEndEvent):  # (implied after a document's scalar: not read)
                    last = event
                if isinstance(event, yaml.CollectionStartEvent):
                    open_.append(event)
                elif isinstance(event, yaml.CollectionEndEvent) and open_:
                    open_.pop()
        finally:
            loader.dispose()
    except yaml.YAMLError:
        pass
    return open_, last


def _run_on(text: str, mark: yaml.Mark) -> tuple[yaml.Mark, str] | None:
    """Where the plain scalar that the parser was reading when a ':' at
    ``mark`` was refused began, when that was on an earlier line, and how it
    reads: "key" (first on its line, where a key goes, or a value on a line
    of its own with deeper lines under it, as a key's entries), "value"
    (after its key's ':', or on a line of its own, one word, with the next
    line as deep: ``model:\n  sim\n  seed: 0``, a key indented too deep) or
    "key or value" (on a line of its own with more words, as
    ``limits:\n  rpm 600\n  tpm: 5``). A plain scalar goes on over the
    lines indented deeper than its mapping, so a key written without its ':'
    swallows the lines under it, up to the first ':' it meets, which YAML
    refuses in a scalar that spans lines: the parser stops there, lines
    after the mistake. libyaml's error has no context mark (and where a
    mapping that has not begun yet is concerned, no "simple key" to name), so
    the tokens are read again with PyYAML's own scanner, up to its error."""
    last: list[yaml.Token] = []  # the last two tokens read (the scanner's look-ahead included)
    try:
        scanner = yaml.SafeLoader(_through_line(text, mark.line))
        try:
            while scanner.check_token():
                last = (last + [scanner.get_token()])[-2:]
        finally:
            scanner.dispose()
    except yaml.MarkedYAMLError as e:
        if not (e.problem_mark and e.problem_mark.line == mark.line):
            return None  # (the scanners disagree: name no other line)
        last = (last + list(scanner.tokens))[-2:]
    except yaml.YAMLError:
        return None
    if not last or not isinstance(last[-1], yaml.ScalarToken) or last[-1].style is not None:
        return None
    scalar = last[-1]
    start = scalar.start_mark
    if start.line >= mark.line:
        return None
    if not (len(last) == 2 and isinstance(last[0], yaml.ValueToken)):
        return start, "key"
    if last[0].end_mark.line == start.line:
        return start, "value"
    lines = text.splitlines()
    if mark.line >= len(lines):
        return None
    first, after = lines[start.line][start.column:], next((t for t in lines[start.line + 1:] if t.strip()), "")
    if len(after) - len(after.lstrip(" ")) > start.column:
        return start, "key"
    return start, "key or value" if len(first.split()) > 1 else "value"


def cut(text: str) -> str:
    """``text``, cut short for a message."""
    return text if len(text) <= 60 else text[:57] + "..."
