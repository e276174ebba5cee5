"""One error type for everything a user typed wrong, so every front end prints one line."""

from __future__ import annotations

# sbatch's exit status for input it refuses while reading its options (getopt errors, a stray word in
# a directive, a malformed time, memory size or node count: exit(-1)); what the controller or its
# GPU checks refuse exits 1 (measured with sbatch 22.05 on the local cluster).
SBATCH_USAGE = 255

# Line breaks and other white space become a space; any other control character (C0, DEL, C1: a
# terminal's escape sequences, its bell, 8-bit CSI) a '?'. U+2028/2029 break lines as well. A
# translation table, not regular expressions: a rewrite's note would compile them on every submission.
_ONE_LINE = str.maketrans({**{chr(c): "?" for c in (*range(0x20), *range(0x7F, 0xA0))},
                           **dict.fromkeys("\t\n\v\f\r\x1c\x1d\x1e\x1f\x85\u2028\u2029", " ")})


def one_line(text: str) -> str:
    """Text that came from elsewhere (a daemon's reasons, a file, an exception), shown to a user as
    one line that cannot move their cursor, retitle their terminal or ring its bell."""
    return text.translate(_ONE_LINE)


class InputError(Exception):
    """Bad input: a file, line and option the user can go and fix."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 option: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.option = option
        self.exit_code = exit_code  # sbatch's for the same input: 1, or SBATCH_USAGE

    def located(self, *, file: str | None = None, line: int | None = None) -> InputError:
        """Return the same error with a location filled in where it had none."""
        return InputError(self.message, file=self.file or file, line=self.line or line,
                          option=self.option, exit_code=self.exit_code)

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "") + ": "
        elif self.line:
            where = f"line {self.line}: "
        opt = f"{self.option}: " if self.option else ""
        return f"{where}{opt}{self.message}"


class ConfigError(InputError):
    """The admin config is unreadable or inconsistent."""
