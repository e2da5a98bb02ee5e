"""The graph cache: a traced ``ModelGraph`` kept on disk, so a repeated ``plan`` never re-traces.

Contract:

- Where: ``$XDG_CACHE_HOME/autopar/graphs`` (else ``~/.cache/autopar/graphs``), one JSON file per
  entry. Deleting the directory, or any file in it, is always safe: a missing entry is rebuilt.
- Key: the sha256 of everything the graph depends on -- the model file's bytes, its name, the tracing inputs
  (sequence length, dtype), the torch version (read from package metadata: no import), autopar's
  version, the source of autopar's tracing code (``autopar/graph``, ``autopar/spec``, ``modelfile.py`` and what it applies at build,
  ``autopar/models``) and the shape of the ModelGraph dataclasses. Any change is a new key.
- Beyond the key: what the build read besides the file's bytes -- the environment variables its
  code read, the files it opened outside the installed packages (a config file, a module beside
  it) -- is stored with the entry and must read the same for a hit (graph/build_inputs.py).
- Format: JSON, never pickle -- a cache file is data, not code. ``ModelGraph`` is serialised
  generically from its dataclass fields and their type hints (nested dataclasses, dicts, tuples,
  optionals; the networkx graph is not stored, it is a view of the other fields), so a field added
  to it needs no code here.
- Trust: on load every value is checked against its declared type and the dataclasses validate
  themselves; an entry that is unreadable, malformed, of another key or another schema is
  ignored (and overwritten by the rebuilt one), never trusted.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import hashlib
import json
import os
import sys
import types
import typing
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from autopar.errors import ModelFileError
from autopar.graph.build_inputs import recording, unchanged
from autopar.graph.model_graph import ModelGraph

SCHEMA_VERSION = 1  # bump when the entry layout (not ModelGraph: that is fingerprinted) changes
_PACKAGE = Path(__file__).resolve().parent.parent  # autopar/
_TRACING_SOURCES = ("graph", "spec", "modelfile.py", "block_dict.py", "input_cast.py", "models")


class _Corrupt(Exception):
    """A cache entry that does not decode to what its types say: ignored, then rebuilt."""


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A model file as the planner needs it once its graph exists: where it is and its hash.

    ``declared_seq_len`` is the file's SEQ_LEN (None when it declares none)."""

    path: Path
    sha256: str
    declared_seq_len: int | None

    @property
    def name(self) -> str:
        return self.path.stem


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autopar`` when set (and absolute, as the XDG spec asks), else ``~/.cache/autopar``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "autopar"


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def _code_sha256() -> str:
    """Hash of the source files that decide what a trace measures (milliseconds to read)."""
    h = hashlib.sha256()
    for part in _TRACING_SOURCES:
        root = _PACKAGE / part
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(_PACKAGE)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def schema_fingerprint(tp: Any = ModelGraph) -> str:
    """A text naming every dataclass field (recursively) of ``tp`` and its type: changes with them."""
    seen: set[type] = set()
    parts: list[str] = []

    def walk(t: Any) -> None:
        for arg in typing.get_args(t):
            walk(arg)
        if dataclasses.is_dataclass(t) and isinstance(t, type) and t not in seen:
            seen.add(t)
            try:
                hints = typing.get_type_hints(t)
            except Exception:  # noqa: BLE001 - an unresolvable hint: its text still names the type
                hints = {f.name: f.type for f in dataclasses.fields(t)}
            parts.append(t.__qualname__ + "(" + ",".join(f"{f.name}:{hints[f.name]}"
                                                          for f in dataclasses.fields(t) if f.init) + ")")
            for f in dataclasses.fields(t):
                walk(hints[f.name])

    walk(tp)
    return ";".join(parts)


def graph_key(*, file_sha256: str, name: str, seq_len: int | None, dtype: str) -> dict[str, Any]:
    """Everything a cached graph depends on (see the module docstring)."""
    from autopar.version import __version__

    return {
        "schema": SCHEMA_VERSION, "model_sha256": file_sha256, "model_name": name, "seq_len": seq_len,
        "dtype": dtype, "torch": _torch_version(), "autopar": __version__, "code_sha256": _code_sha256(),
        "graph_schema_sha256": hashlib.sha256(schema_fingerprint().encode()).hexdigest(),
    }


def _entry_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "graphs" / f"{key['model_name']}-{digest[:32]}.json"


# -- generic encoding of dataclasses -----------------------------------------------------------


def encode(value: Any) -> Any:
    """JSON-ready data of a dataclass tree (TypeError on a value this format cannot hold)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, dict):
        return {_str_key(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return _plain(value)


def _str_key(k: Any) -> str:
    if not isinstance(k, str):
        raise TypeError(f"cache keys must be strings, got {k!r}")
    return k


def _plain(value: Any) -> Any:
    """A JSON value as is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {_str_key(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    raise TypeError(f"cannot store {type(value).__name__} in the graph cache")


def decode(tp: Any, data: Any, where: str = "graph") -> Any:
    """The value of type ``tp`` that ``encode`` wrote as ``data``; _Corrupt if it does not match."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return decode(arg, data, where)
            except _Corrupt as exc:
                errors.append(str(exc))
        raise _Corrupt("; ".join(errors) or f"{where}: no type matches")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise _Corrupt(f"{where}: expected a mapping for {tp.__name__}")
        try:
            hints = _type_hints(tp)
        except Exception as exc:  # noqa: BLE001 - then this entry cannot be checked: not trusted
            raise _Corrupt(f"{where}: type hints of {tp.__name__} do not resolve: {exc}") from None
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        if set(data) != set(fields):
            raise _Corrupt(f"{where}: fields {sorted(data)} are not {tp.__name__}'s {sorted(fields)}")
        try:
            return tp(**{name: decode(hints[name], data[name], f"{where}.{name}") for name in fields})
        except (TypeError, ValueError) as exc:
            raise _Corrupt(f"{where}: {tp.__name__} refused the values: {exc}") from None
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(data, dict):
            raise _Corrupt(f"{where}: expected a mapping")
        kt, vt = args or (str, Any)
        return {decode(kt, k, where): decode(vt, v, f"{where}[{k!r}]") for k, v in data.items()}
    if origin in (tuple, list):
        if not isinstance(data, list):
            raise _Corrupt(f"{where}: expected a list")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(data):
                raise _Corrupt(f"{where}: expected {len(args)} items, got {len(data)}")
            return tuple(decode(a, d, f"{where}[{i}]") for i, (a, d) in enumerate(zip(args, data)))
        item = args[0] if args else Any
        items = [decode(item, d, f"{where}[{i}]") for i, d in enumerate(data)]
        return tuple(items) if origin is tuple else items
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise _Corrupt(f"{where}: expected a number")
        return float(data)
    if tp in (int, str, bool):
        if type(data) is not tp:
            raise _Corrupt(f"{where}: expected {tp.__name__}, got {type(data).__name__}")
        return data
    if tp is type(None):
        if data is not None:
            raise _Corrupt(f"{where}: expected null")
        return None
    raise _Corrupt(f"{where}: the cache cannot decode {tp!r}")


@functools.lru_cache(maxsize=None)
def _type_hints(tp: type) -> dict[str, Any]:
    """``typing.get_type_hints`` of a dataclass, once per class: a graph holds hundreds of records
    of a few classes, and resolving their hints was two thirds of a warm load."""
    return typing.get_type_hints(tp)



# -- entries -----------------------------------------------------------------------------------


def load_entry(key: dict[str, Any]) -> tuple[ModelGraph, int | None] | None:
    """(graph, declared SEQ_LEN) stored under ``key``, or None when absent or not trustworthy."""
    path = _entry_path(key)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(entry, dict) or entry.get("key") != key:
            raise _Corrupt("another key")
        declared = decode(int | None, entry.get("declared_seq_len"), "declared_seq_len")
        inputs = decode(dict[str, dict[str, str | None]], entry.get("inputs", {}), "inputs")
        if not unchanged(inputs):  # the build read an environment variable or file that now differs
            return None
        graph = decode(ModelGraph, entry.get("graph"))
    except (OSError, UnicodeDecodeError, ValueError, _Corrupt, RecursionError):
        return None
    if graph.sha256 != key["model_sha256"] or graph.dtype != key["dtype"]:
        return None
    return graph, declared


def store_entry(key: dict[str, Any], graph: ModelGraph, declared_seq_len: int | None,
                inputs: dict[str, dict[str, str | None]] | None = None) -> Path | None:
    """Write the entry atomically (a reader never sees half of one); None if the cache is not
    writable. ``inputs``: what the build read besides the file's bytes (graph/build_inputs.py)."""
    path = _entry_path(key)
    try:
        text = json.dumps({"key": key, "declared_seq_len": declared_seq_len, "inputs": inputs or {},
                           "graph": encode(graph)}, separators=(",", ":"))
    except (TypeError, ValueError):
        return None  # a value JSON cannot hold exactly: do not cache rather than cache it wrong
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return None
    return path


# -- the one entry point the planner uses --------------------------------------------------------


def cached_graph(model: Any, *, seq_len: int | None, dtype: str, use_cache: bool = True,
                 on_miss: Callable[[], None] | None = None) -> tuple[ModelGraph, ModelSource]:
    """The graph of ``model`` (a path or a loaded ``ModelFile``) traced at ``seq_len`` and ``dtype``.

    On a hit nothing but the file's bytes is read: the model file is not imported and torch is not
    loaded. On a miss (or ``use_cache=False``) the file is loaded and traced, and the entry written.
    """
    mf = _as_model_file(model)
    if mf is not None:
        path, sha = mf.path, mf.sha256
    else:
        path = Path(model)
        if not path.is_file():
            raise ModelFileError(f"model file {path} does not exist")
        if path.suffix != ".py":
            raise ModelFileError(f"model file {path} must be a Python file ending in .py")
        try:
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise ModelFileError(f"model file {path} cannot be read: {exc.strerror}") from None
    key = graph_key(file_sha256=sha, name=path.stem, seq_len=seq_len, dtype=dtype)
    if use_cache:
        hit = load_entry(key)
        if hit is not None:
            return hit[0], ModelSource(path=path, sha256=sha, declared_seq_len=hit[1])
    if on_miss:
        on_miss()
    from autopar.graph.measure import build_graph
    from autopar.modelcheck import check_example_inputs
    from autopar.modelfile import load_model_file

    with recording(path) as inputs:  # what the build reads besides the file's bytes: part of the entry
        mf = mf or load_model_file(path)
        check_example_inputs(mf)  # the contract check; a hit's bytes passed it when they were traced
        if mf.sha256 != sha:  # the file changed between hashing and importing: key the bytes imported
            key = graph_key(file_sha256=mf.sha256, name=path.stem, seq_len=seq_len, dtype=dtype)
        graph = build_graph(mf, seq_len=seq_len, dtype=dtype, memo=not use_cache)
    if use_cache:
        store_entry(key, graph, mf.seq_len, inputs)
    return graph, ModelSource(path=mf.path, sha256=mf.sha256, declared_seq_len=mf.seq_len)


def _as_model_file(model: Any) -> Any:
    """``model`` if it is a loaded ModelFile (only possible once autopar.modelfile is imported)."""
    mod = sys.modules.get("autopar.modelfile")
    return model if mod is not None and isinstance(model, mod.ModelFile) else None
