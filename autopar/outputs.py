"""Where autopar writes its outputs (plans, reports, traces, profiles): checked first, written atomically.

Contract of ``write_text_atomic(path, text)``:

* the text goes to a temporary file in the target's directory, is flushed and fsynced, then
  renamed over the target: a crash, a full disk or a signal never leaves half a file;
* the result is a regular file. A symlink is followed (its target is replaced, the link kept).
  A target that is a directory, a device, a FIFO or a socket is refused with a one-line
  ``OutputError`` -- ``plan -o /dev/full`` never turns the device node into a file;
* a new file gets the user's umask (``0o666 & ~umask``); an existing regular file keeps its mode;
* any ``OSError`` (no permission, no space, read-only filesystem) becomes one line naming the
  path and the cause, and the temporary file is removed.

``check_output_file(path, flag)`` and ``check_output_dir(path, flag)`` run the same checks before
any work starts (``autopar run`` checks every output location before training), and prove the
directory writable by creating and removing a probe file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from autopar.errors import AutoparError


class OutputError(AutoparError):
    """An output path that cannot be written (exit code 2)."""


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask is process-wide and racy in threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return None


def resolve_target(path: str | os.PathLike[str], flag: str = "output") -> Path:
    """The file that writing ``path`` replaces (symlinks followed); refuses what is not a regular
    file or a new name in an existing directory."""
    p = Path(path)
    if str(p) == "" or p.name in ("", ".", ".."):
        raise OutputError(f"{flag} {str(path)!r} is not a file name")
    target = Path(os.path.realpath(p)) if p.is_symlink() else p
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OutputError(f"{flag} {p}: {exc.strerror}") from None
    if st is not None:
        kind = _kind(st.st_mode)
        if kind is not None:
            raise OutputError(f"{flag} {p} is {kind}; give the path of a regular file")
    return target


def check_output_file(path: str | os.PathLike[str], flag: str = "output", *, create_parent: bool = True) -> Path:
    """Everything ``write_text_atomic(path, ...)`` needs, checked now (one-line OutputError)."""
    target = resolve_target(path, flag)
    parent = target.parent if str(target.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"{flag} {path}: {parent} is not a directory")
    if not parent.exists() and not create_parent:
        raise OutputError(f"{flag} {path}: directory {parent} does not exist")
    check_output_dir(parent, flag)
    return target


def check_output_dir(path: str | os.PathLike[str], flag: str = "output directory") -> Path:
    """``path`` is (or can be made) a directory this process can create files in."""
    d = Path(path) if str(path) else Path(".")
    if d.exists() and not d.is_dir():
        raise OutputError(f"{flag} {d} exists and is not a directory")
    existing = d
    while not existing.exists():  # the nearest existing ancestor must let us create the rest
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"{flag} {d}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {d}: no permission to write in {existing}")
    if existing == d:
        try:
            fd, probe = tempfile.mkstemp(prefix=".autopar-probe.", dir=d)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise OutputError(f"{flag} {d} is not writable: {exc.strerror}") from None
    return d


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, flag: str = "output") -> Path:
    """Write ``data`` to ``path`` by the contract in the module docstring. Returns ``path``."""
    p = Path(path)
    target = resolve_target(p, flag)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {flag} {p}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            os.fchmod(fh.fileno(), mode)
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {flag} {p}: {exc.strerror or exc}") from None
        raise
    return p


def write_text_atomic(path: str | os.PathLike[str], text: str, flag: str = "output") -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), flag)
