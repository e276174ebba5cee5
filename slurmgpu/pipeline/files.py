"""Reading a file a path names without hanging on it: the admin config, a model bundle, a cache.

``open()`` on a FIFO waits for a writer, for ever, and a device such as /dev/zero reads without
end; gsbatch would hang until killed, with nothing submitted. So these are opened as the ingest
opens spool records: non-blocking (a FIFO opens at once, and is then refused), checked with
``fstat`` to be a regular file, and read up to a size cap. Anything else raises ``FileRefused``, an
OSError, which every caller already takes as "unreadable": the job goes as written.
"""

from __future__ import annotations

import errno
import os
import stat

from slurmgpu.typing_lite import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import BinaryIO

_KINDS = ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
          (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISSOCK, "socket"))


class FileRefused(OSError):
    """A path that is not a regular file of at most the size its reader takes; it was not read."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EINVAL, why, path)

    def __str__(self) -> str:  # the reason alone: callers name the file themselves
        return str(self.strerror)


def kind_of(mode: int) -> str:
    """What a file is, in words, from its ``st_mode``."""
    return next((name for test, name in _KINDS if test(mode)), "special file")


def open_regular(path: str, max_bytes: int, *, follow: bool = True) -> BinaryIO:
    """Open a regular file of at most ``max_bytes`` for reading, never blocking (``follow=False``:
    a symbolic link is refused too); FileRefused for anything else, OSError as ``open``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise FileRefused(path, "a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(path, f"a {kind_of(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise FileRefused(path, f"{st.st_size} bytes, over the {max_bytes}-byte limit")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(fh: BinaryIO, max_bytes: int, path: str) -> bytes:
    """The rest of an open file, refused when it has grown past ``max_bytes`` since it was opened."""
    data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileRefused(path, f"over the {max_bytes}-byte limit")
    return data


def read_regular(path: str, max_bytes: int, *, follow: bool = True) -> bytes:
    """A regular file's bytes (``open_regular``'s checks), all of them or FileRefused."""
    with open_regular(path, max_bytes, follow=follow) as fh:
        return read_capped(fh, max_bytes, path)
