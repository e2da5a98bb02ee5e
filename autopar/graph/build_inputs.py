"""What a model file's build read besides its own bytes, so the graph cache cannot return another model.

A graph is cached under the model file's bytes (graph/cache.py). A file that takes its size from
an environment variable (``WIDTH = int(os.environ["WIDTH"])``), from a config file beside it, or
from a module of its own that it imports builds a different model from the same bytes. On a cache
miss, while the file is imported, built and traced, ``recording`` notes

* each environment variable the user's code reads (a read from a frame of a file in the model
  file's folder, or below it) and its value (None: unset);
* each file opened for reading outside Python's own and the installed packages' folders (a config
  file, a module beside the model, a tokenizer's files) that still exists when the build ends: its
  sha256 (size and mtime above ``HASH_LIMIT_BYTES``);

and ``unchanged`` tells on a hit whether every one still reads the same: if not, the entry is not
used. A size drawn at random, or from anything else outside the process, is not seen: pass
``--no-cache`` for such a file.
"""

from __future__ import annotations

import collections.abc
import hashlib
import os
import site
import sys
import sysconfig
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

HASH_LIMIT_BYTES = 64 * 2**20  # larger files (weights) are known by size and mtime
_SKIP_DIRS = ("/proc/", "/sys/", "/dev/")


def _library_dirs() -> tuple[str, ...]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            *(p for p in sysconfig.get_paths().values() if p)}
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    dirs.add(str(Path(__file__).resolve().parents[1]))  # autopar itself
    return tuple(sorted(os.path.join(os.path.realpath(d), "") for d in dirs if d))


class _Recorder:
    """The reads of one recording (``recording``)."""

    def __init__(self, model_path: Path) -> None:
        self.user_dir = os.path.join(os.path.realpath(model_path.parent), "")
        self.model = os.path.realpath(model_path)
        self.library = _library_dirs()
        self.env: dict[str, str | None] = {}
        self.files: set[str] = set()

    def user_frame(self) -> bool:
        """Whether the environment read comes from the user's code (a file in the model's folder)."""
        frame = sys._getframe(3)
        for _ in range(8):
            if frame is None:
                return False
            name = os.path.realpath(frame.f_code.co_filename)
            if name.startswith(self.user_dir):
                return True
            if not (name.endswith(os.sep + "os.py") or name.endswith("_collections_abc.py")):
                return False
            frame = frame.f_back
        return False

    def opened(self, path: Any, mode: Any) -> None:
        if not isinstance(path, (str, bytes, os.PathLike)) or (isinstance(mode, str) and any(c in mode for c in "wax+")):
            return
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError, OSError):
            return
        if (real == self.model or real.endswith(".pyc") or real.startswith(_SKIP_DIRS) or real.startswith(self.library)
                or os.path.isdir(real)):
            return  # a compiled module stands for its source, recorded when that was opened
        self.files.add(real)


_ACTIVE: list[_Recorder] = []
_LOCK = threading.Lock()
_HOOKED = [False]


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _ACTIVE and args:
        _ACTIVE[-1].opened(args[0], args[1] if len(args) > 1 else "r")


class _RecordingEnviron(collections.abc.MutableMapping):
    """``os.environ`` while recording: every read the user's code makes is noted."""

    def __init__(self, inner: Any, recorder: _Recorder) -> None:
        self._inner, self._recorder = inner, recorder

    def _note(self, key: Any) -> None:
        if isinstance(key, str) and self._recorder.user_frame():
            self._recorder.env.setdefault(key, self._inner.get(key))

    def __getitem__(self, key: Any) -> str:
        self._note(key)
        return self._inner[key]

    def __contains__(self, key: Any) -> bool:
        self._note(key)
        return key in self._inner

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return self._inner.get(key, default)

    def __setitem__(self, key: str, value: str) -> None:
        self._inner[key] = value

    def __delitem__(self, key: str) -> None:
        del self._inner[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def copy(self) -> dict[str, str]:
        return dict(self._inner)

    def __getattr__(self, name: str) -> Any:  # putenv / encodekey and the like: the real mapping's
        return getattr(self._inner, name)


def file_digest(path: str) -> str | None:
    """What ``unchanged`` compares for a file: its sha256 (size and mtime when large), None if absent."""
    try:
        st = os.stat(path)
        if st.st_size > HASH_LIMIT_BYTES:
            return f"size:{st.st_size}:mtime:{st.st_mtime_ns}"
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


@contextmanager
def recording(model_path: Path) -> Iterator[dict[str, dict[str, str | None]]]:
    """Record what the build inside reads (module docstring); the yielded dict is filled on exit
    with ``{"env": {name: value}, "files": {path: digest}}``."""
    rec = _Recorder(Path(model_path))
    out: dict[str, dict[str, str | None]] = {"env": {}, "files": {}}
    with _LOCK:
        if not _HOOKED[0]:
            sys.addaudithook(_audit)  # permanent once added: it does nothing while no recording is active
            _HOOKED[0] = True
    inner = os.environ
    os.environ = _RecordingEnviron(inner, rec)  # type: ignore[assignment]  # noqa: B003 - a view, restored below
    _ACTIVE.append(rec)
    try:
        yield out
    finally:
        _ACTIVE.remove(rec)
        os.environ = inner  # type: ignore[assignment]  # noqa: B003 - the real mapping back
        out["env"] = dict(sorted(rec.env.items()))
        # a file gone by the end (a temporary one) is not watched
        out["files"] = {p: d for p in sorted(rec.files) if (d := file_digest(p)) is not None}


def unchanged(inputs: dict[str, dict[str, str | None]]) -> bool:
    """Whether every environment variable and file a build read still reads the same."""
    env, files = inputs.get("env", {}), inputs.get("files", {})
    return (all(os.environ.get(k) == v for k, v in env.items())
            and all(file_digest(p) == d for p, d in files.items()))
