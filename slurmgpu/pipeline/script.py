"""Read a batch script the way sbatch reads it.

sbatch only honours ``#SBATCH`` at the very start of a line, and only until the first line
that is neither blank nor a comment; each directive line is split into words with sbatch's own
quoting rules (quotes group, backslash escapes, an unquoted ``#`` starts a comment). A line
whose first word is ``hetjob`` (or the older ``packjob``) starts the next heterogeneous
component, and nothing else on that line is read. A component's directive words are one argv to
sbatch, so an option's value may stand on the next ``#SBATCH`` line. ``#PBS``/``#BSUB`` lines are
kept for ``pipeline.wrapper``, which translates them as sbatch does.
Every word keeps its character span, so a rewrite can replace exactly the words it must.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Iterable

from slurmgpu.pipeline.errors import SBATCH_USAGE, InputError
from slurmgpu.pipeline.sbatch_options import OptionError, split_options
from slurmgpu.typing_lite import NamedTuple

MAGIC = "#SBATCH"
# gsbatch's own in-script options: sbatch ignores these lines, so a script that carries them still
# goes through plain sbatch. Read like #SBATCH lines: at a line's start, before the first command.
GS_MAGIC = "#GSBATCH"
GS_OPTIONS = ("--no-rewrite", "--gpu-mem")
GPU_MEM = "--gpu-mem"  # --gpu-mem=SIZE: a GPU type with at least that much memory per GPU
# The first opt-out spelling; sbatch 22.05 refuses a script with it ("Change from #SLURM to #SBATCH").
# Compiled on first use (re caches it): only a script holding "#SLURMGPU" is searched for it.
LEGACY_KEEP = r"(?m)^#SLURMGPU[ \t]+keep\b"
_LOOKS_LIKE_DIRECTIVE = re.compile(r"^[ \t]*#+[ \t]*sbatch", re.IGNORECASE)
_HETJOB = re.compile(r"hetjob|packjob", re.IGNORECASE)  # as a line's first word
_SPACE = frozenset(" \t\n\v\f\r")  # C's isspace(), not Unicode's
# Other schedulers' directives that sbatch translates (src/sbatch/xlate.c), in the order it tries them:
# only the first kind found is read, from anywhere in the script until more than 100 lines that do
# not start with '#' have passed (the first command does not stop it). --ignore-pbs skips both.
WRAPPERS = ("#BSUB", "#PBS")
_WRAPPER_LINES = 100
_PLAIN = re.compile(r"[^ \t\n\v\f\r]+")  # a word between _SPACE, on a line without _QUOTING
# The newline before a line that is a comment (or a directive): a literal first, so re scans for it in C
# (as '^' with MULTILINE it tries every position: 40 ms on a 3.9 MB script, this 4 ms).
_COMMENT_LINE = re.compile(r"\n[ \t\v\f\r]*#")
_QUOTING = re.compile(r"[\\\"'#]")  # what _get_argument reads specially

# sbatch's own words for scripts it refuses (src/sbatch/sbatch.c).
NOT_A_SCRIPT = ("This does not look like a batch script.  The first line must start with #! "
                "followed by the path to an interpreter.")
DOS_BREAKS = "Batch script contains DOS line breaks (\\r\\n) instead of expected UNIX line breaks (\\n)."
EMPTY = "Batch script is empty!"
NUL_CHAR = "The Slurm controller does not allow scripts that contain a NULL character '\\0'."


class Word(NamedTuple):
    """One word of a directive line: its unquoted text and where it stands in the script."""

    text: str
    start: int  # offset into BatchScript.text
    end: int


class Directive(NamedTuple):
    """One option set by a ``#SBATCH`` line."""

    line: int
    component: int
    name: str  # canonical long option name (or the word itself when sbatch has no such option)
    value: str | None
    words: tuple[Word, ...]  # the one or two words that spell it
    known: bool = True

    @property
    def start(self) -> int:
        return self.words[0].start

    @property
    def end(self) -> int:
        return self.words[-1].end


class IgnoredDirective(NamedTuple):
    line: int
    text: str
    reason: str


class BatchScript(NamedTuple):
    """A parsed batch script; ``text`` round-trips to the exact original bytes."""

    path: str
    text: str
    shebang: str
    directives: tuple[Directive, ...]
    ignored: tuple[IgnoredDirective, ...]
    components: int
    first_command_line: int | None
    line_starts: tuple[int, ...]
    gsbatch_options: tuple[str, ...] = ()  # from #GSBATCH lines (option names; values below)
    legacy_keep: bool = False  # a '#SLURMGPU keep' line
    gpu_mem: tuple[str, int] | None = None  # '#GSBATCH --gpu-mem=SIZE': (SIZE as written, line); the last wins
    wrapper: str | None = None  # '#BSUB' or '#PBS': the one kind of foreign directive sbatch translates
    wrapper_lines: tuple[tuple[int, int, int], ...] = ()  # its lines: (line, offset after the magic, line end)

    @property
    def keep_marker(self) -> bool:
        """The script opts out of rewriting."""
        return "--no-rewrite" in self.gsbatch_options or self.legacy_keep

    @property
    def keep_spelled(self) -> str:
        """The script's opt-out line as it spells it."""
        return "#GSBATCH --no-rewrite" if "--no-rewrite" in self.gsbatch_options else "#SLURMGPU keep"

    @property
    def keep_reason(self) -> str:
        """Why the request stands, in the script's own spelling."""
        return f"the script says '{self.keep_spelled}'; request kept"

    @property
    def data(self) -> bytes:
        return encode(self.text)

    def line_end(self, line: int) -> int:
        """Offset just past line ``line``'s newline (or the end of the text)."""
        return self.line_starts[line] if line < len(self.line_starts) else len(self.text)

    def component_directives(self, component: int) -> list[Directive]:
        return [d for d in self.directives if d.component == component]


def decode(data: bytes) -> str:
    """Bytes to text without losing any byte: invalid UTF-8 survives a round trip."""
    return data.decode("utf-8", errors="surrogateescape")


def encode(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


# The most directive-like lines (#SBATCH, #PBS, #BSUB, #GSBATCH) gsbatch reads in a script. sbatch
# reads 160k of them in 40 ms, in C; each costs gsbatch some 20 us (tokens, options, the request),
# and no real script comes near this many.
DIRECTIVE_BUDGET = 2_000
_DIRECTIVE_STARTS = (b"#SBATCH", b"#PBS", b"#BSUB", b"#GSBATCH")


class Unread(ValueError):
    """A script with more directive lines than gsbatch reads: it goes to sbatch as written."""

    def __init__(self, message: str, data: bytes) -> None:
        super().__init__(message)
        self.data = data


def directive_lines(data: bytes) -> int:
    """Lines starting as a directive, counted in C (a #GSBATCH line counts twice: an upper bound)."""
    return sum(data.count(b"\n" + start) + data.startswith(start) for start in _DIRECTIVE_STARTS)


def read_script(path: str) -> BatchScript:
    """Read and parse a script file; every failure is an InputError naming the file."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except IsADirectoryError:
        raise InputError("is a directory, not a batch script", file=path) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", file=path) from None
    return parse_script(data, path)


def check_acceptable(data: bytes, path: str) -> None:
    """Refuse what sbatch refuses, with sbatch's reason."""
    if not data:
        raise InputError(EMPTY, file=path)
    if b"\0" in data:
        raise InputError(NUL_CHAR + " (binary file?)", file=path, line=data[: data.index(b"\0")].count(b"\n") + 1)
    if not data.startswith(b"#!"):
        raise InputError(NOT_A_SCRIPT, file=path, line=1)
    if b"\r\n" in data:
        raise InputError(DOS_BREAKS, file=path, line=data[: data.index(b"\r\n")].count(b"\n") + 1)


def tokenize(text: str, start: int, end: int, path: str, lineno: int) -> list[Word]:
    """Split text[start:end] into words as sbatch's _get_argument does."""
    if _QUOTING.search(text, start, end) is None:  # no quote, escape or comment: split in C
        words = [Word(m.group(), m.start(), m.end()) for m in _PLAIN.finditer(text, start, end)]
        if any(w.text.startswith(":") for w in words):
            raise InputError("Unexpected `:`", file=path, line=lineno)
        return words
    words = []
    i = start
    while True:
        while i < end and text[i] in _SPACE:
            i += 1
        if i >= end:
            return words
        if text[i] == ":":
            raise InputError("Unexpected `:`", file=path, line=lineno)
        begin = i
        out: list[str] = []
        quote = ""
        while i < end and (quote or text[i] not in _SPACE):
            ch = text[i]
            if ch == "\\":  # escapes the next character, but (unquoted) never a space
                i += 1
                if i < end and (quote or text[i] not in _SPACE):
                    out.append(text[i])
                    i += 1
                continue
            if quote:
                if ch == quote:
                    quote = ""
                else:
                    out.append(ch)
                i += 1
                continue
            if ch in "\"'":
                quote = ch
                i += 1
                continue
            if ch == "#":
                break
            out.append(ch)
            i += 1
        if quote:
            raise InputError(f"Unmatched `{quote}`", file=path, line=lineno)
        if i > begin:
            words.append(Word("".join(out), begin, i))
        if i < end and text[i] == "#":
            return words


def _line_end(text: str, starts: list[int], idx: int) -> int:
    """Where line ``idx`` (from 0) ends in ``text``, its newline left out."""
    end = starts[idx + 1] - 1 if idx + 1 < len(starts) else len(text)
    return end - 1 if end > starts[idx] and text[end - 1] == "\n" else end


def parse_script(data: bytes, path: str = "<stdin>") -> BatchScript:
    """Parse script bytes into directives, ignored directive-like lines and components; Unread
    past ``DIRECTIVE_BUDGET`` directive lines."""
    check_acceptable(data, path)
    if (count := directive_lines(data)) > DIRECTIVE_BUDGET:
        raise Unread(f"{path}: {count:,} directive lines, more than gsbatch reads ({DIRECTIVE_BUDGET:,})", data)
    text = decode(data)
    # where each line starts: after each newline, summed in C (a 3.9 MB script has 60k lines)
    starts = list(itertools.accumulate(map((1).__add__, map(len, text.split("\n"))), initial=0))[:-1]
    if starts[-1] == len(text):
        starts.pop()
    directives: list[Directive] = []
    ignored: list[IgnoredDirective] = []
    gs_options: list[str] = []
    gs_values: dict[str, tuple[str, int]] = {}
    component = 0
    first_command: int | None = None
    pending: list[tuple[int, Word]] = []  # one component's directive words: sbatch reads them as one argv
    wrappers: dict[str, list[tuple[int, int, int]]] = {WRAPPERS[0]: [], WRAPPERS[1]: []}
    non_comments = 0
    tail: int | None = None
    for idx, begin in enumerate(starts):
        if first_command is not None and non_comments > _WRAPPER_LINES:
            tail = idx  # past the first command and #PBS's window: only comment lines can still say anything
            break
        lineno = idx + 1
        end = _line_end(text, starts, idx)
        line = text[begin:end]
        if non_comments <= _WRAPPER_LINES:  # sbatch's #PBS/#BSUB reader (src/sbatch/xlate.c)
            magic = next((m for m in WRAPPERS if line.startswith(m)), None)
            if magic:
                wrappers[magic].append((lineno, begin + len(magic), end))
            elif not line.startswith("#"):
                non_comments += 1
        if lineno == 1:
            continue  # the shebang
        if line.startswith(MAGIC):
            if first_command is not None:
                ignored.append(IgnoredDirective(lineno, line, f"after the first command (line {first_command})"))
                continue
            words = tokenize(text, begin + len(MAGIC), end, path, lineno)
            if words and _HETJOB.fullmatch(words[0].text):
                directives.extend(_directives_of(pending, component, path))
                pending = []
                component += 1  # sbatch reads nothing else on a separator line
                continue
            pending.extend((lineno, w) for w in words)
            continue
        if line.startswith(GS_MAGIC):
            gs_options.extend(_gsbatch_options(text, begin, end, path, lineno, first_command, ignored, gs_values))
            continue
        stripped = line.lstrip(" \t\v\f\r")
        if stripped and not stripped.startswith("#"):
            if first_command is None:
                first_command = lineno
            continue
        if _LOOKS_LIKE_DIRECTIVE.match(line):
            why = (f"after the first command (line {first_command})" if first_command is not None
                   else "not at the start of the line or not spelled #SBATCH exactly")
            ignored.append(IgnoredDirective(lineno, line, why))
    if tail is not None:  # found in C: a long script's commands cost no Python per line
        for m in _COMMENT_LINE.finditer(text, starts[tail] - 1):
            idx = bisect.bisect_right(starts, m.start() + 1) - 1
            line = text[starts[idx]:_line_end(text, starts, idx)]
            if line.startswith((MAGIC, GS_MAGIC)) or _LOOKS_LIKE_DIRECTIVE.match(line):
                ignored.append(IgnoredDirective(idx + 1, line, f"after the first command (line {first_command})"))
    directives.extend(_directives_of(pending, component, path))
    wrapper = next((m for m in WRAPPERS if wrappers[m]), None)
    first_line_end = starts[1] - 1 if len(starts) > 1 else len(text)
    return BatchScript(
        path=path,
        text=text,
        shebang=text[:first_line_end],
        directives=tuple(directives),
        ignored=tuple(ignored),
        components=component + 1,
        first_command_line=first_command,
        line_starts=tuple(starts),
        gsbatch_options=tuple(dict.fromkeys(gs_options)),
        legacy_keep="#SLURMGPU" in text and bool(re.search(LEGACY_KEEP, text)),  # the substring test is C's
        gpu_mem=gs_values.get(GPU_MEM),
        wrapper=wrapper,
        wrapper_lines=tuple(wrappers[wrapper]) if wrapper else (),
    )


def _gsbatch_options(text: str, begin: int, end: int, path: str, lineno: int, first_command: int | None,
                     ignored: list[IgnoredDirective], values: dict[str, tuple[str, int]] | None = None) -> list[str]:
    """The gsbatch options of one #GSBATCH line. sbatch ignores the line, so nothing on it can
    make gsbatch refuse the script: what it does not know is listed as ignored instead. An
    option's value (``--gpu-mem=24G`` or ``--gpu-mem 24G``) goes into ``values`` with its line;
    it is checked when the plan is made, where a bad one is an error of gsbatch's own option."""
    line = text[begin:end]
    if first_command is not None:
        ignored.append(IgnoredDirective(lineno, line, f"after the first command (line {first_command})"))
        return []
    try:
        words = [w.text for w in tokenize(text, begin + len(GS_MAGIC), end, path, lineno)]
    except InputError as exc:
        ignored.append(IgnoredDirective(lineno, line, f"unreadable gsbatch directive: {exc.message}"))
        return []
    found: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if name == GPU_MEM:
            if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
                value, i = words[i + 1], i + 1
            found.append(name)
            if values is not None:
                values[name] = (value, lineno)
        elif word in GS_OPTIONS and word != GPU_MEM:
            found.append(word)
        else:
            unknown.append(word)
        i += 1
    if unknown:
        name = unknown[0].partition("=")[0]
        near = closest(name, GS_OPTIONS)
        ignored.append(IgnoredDirective(lineno, line, f"{UNKNOWN_GS} {unknown[0]} " + (
            f"(did you mean {near}?)" if near else f"(known: {', '.join(GS_OPTIONS)})")))
    return found


UNKNOWN_GS = "unknown gsbatch option"  # an ignored #GSBATCH line's reason: said on submit, never refused


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known option a mistyped NAME most likely meant (``--gpu-memory`` -> ``--gpu-mem``), or None."""
    import difflib

    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return found[0] if found else None


_SIZE = r"(?i)^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT])(?:i?B)?\s*$"  # compiled when a --gpu-mem is read
_UNIT_GIB = {"K": 1.0 / 1024 ** 2, "M": 1.0 / 1024, "G": 1.0, "T": 1024.0}


def parse_gpu_mem(value: str | None) -> float:
    """``--gpu-mem``'s size in GiB: ``24G``, ``40GB``, ``80GiB``, ``24000M`` (units are powers of
    1024, as in Slurm's ``--mem``). A number without a unit is refused rather than guessed."""
    if value is None or not value.strip():
        raise InputError("needs a size per GPU, e.g. --gpu-mem=24G", option=GPU_MEM)
    m = re.match(_SIZE, value)
    if not m:
        hint = f" (write {value.strip()}G or {value.strip()}M)" if re.fullmatch(r"\s*[\d.]+\s*", value) else ""
        raise InputError(f"cannot read size {value!r}{hint}: a number and a unit, K, M, G or T", option=GPU_MEM)
    gib = float(m.group(1)) * _UNIT_GIB[m.group(2).upper()]
    if gib <= 0:
        raise InputError(f"size {value!r} must be above zero", option=GPU_MEM)
    return gib


def _directives_of(words: list[tuple[int, Word]], component: int, path: str) -> list[Directive]:
    """One component's options. sbatch hands all of a component's directive words to getopt as one
    argv, so an option's value may stand on the next ``#SBATCH`` line (``#SBATCH --time`` then
    ``#SBATCH 10``); a directive keeps the line of its first word."""
    try:
        options, operand = split_options([w.text for _, w in words])
    except OptionError as exc:
        # the word it is about; an argument missing at the component's end: its last line
        line = words[min(exc.at, len(words) - 1)][0] if words and exc.at is not None else None
        raise InputError(str(exc), file=path, line=line, option=exc.option, exit_code=SBATCH_USAGE) from None
    found = [
        Directive(words[o.first][0], component, o.name, o.value, tuple(w for _, w in words[o.first : o.last + 1]),
                  o.known)
        for o in options
    ]
    if operand < len(words):  # sbatch's own refusal of a stray word
        raise InputError(f"Invalid directive found in batch script: {words[operand][1].text}", file=path,
                         line=words[operand][0], exit_code=SBATCH_USAGE)
    return found
