"""Checkpoint integrity: what ``meta.json`` records at save, what resume checks, and a safe
reader for DCP's pickled ``.metadata``.

* ``file_record(dir)``: size and sha256 of every file of a checkpoint (rank 0, at publish).
* ``damage(dir)``: why a checkpoint cannot be trusted (``meta.json`` unreadable, no record, a
  recorded file missing, of another size, or with another checksum), None when intact.
  ``share`` / ``of`` split the hashing over the ranks (each hashes every ``of``-th file).
* ``choose(directory, ...)``: the newest intact checkpoint, newest first over ``latest`` and the
  ``step-N`` directories; every damaged newer one is reported as a one-line warning. Collective
  when a process group is up (every rank hashes its share; all agree on the result).
* ``SafeReader``: DCP's ``FileSystemReader`` with ``read_metadata`` through a restricted
  unpickler that builds only the classes DCP's metadata consists of (``ALLOWED``). Anything else
  -- ``os.system``, ``builtins.eval``, any ``__reduce__`` of a crafted pickle -- is refused before it
  is called, so a hostile checkpoint directory cannot run code on ``--resume``. (A checksum in
  ``meta.json`` is no defence by itself: whoever can rewrite ``.metadata`` can rewrite ``meta.json``.)
* ``check_shapes``: the checkpoint's tensors have the shapes of this model (a same-depth model
  of another width is a one-line error, not DCP's per-rank traceback).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable

from torch.distributed.checkpoint import FileSystemReader

from autopar.errors import AutoparError
from autopar.executor.checkpoint.checkpoint_meta import LATEST, META, CheckpointError, CheckpointMeta

_CHUNK = 1 << 20
_STEP_DIR = re.compile(r"^step-(\d+)$")

# (module, name) pairs that DCP 2.x writes into .metadata; nothing else is constructed.
ALLOWED = frozenset({
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
})


def _is_dtype(module: str, name: str) -> bool:
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _is_memory_format(module: str, name: str) -> bool:
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), torch.memory_format)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or _is_dtype(module, name) or _is_memory_format(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not part of DCP's checkpoint metadata")


class UnsafeCheckpointError(AutoparError):
    """A checkpoint's metadata asks to construct something other than DCP's metadata classes."""


def safe_load_metadata(data: bytes, source: str) -> Any:
    """Unpickle DCP ``.metadata`` bytes with the restricted unpickler (one-line error otherwise)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _RestrictedUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{source}: {exc}; the checkpoint was not loaded") from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbled: a damaged file
        raise UnsafeCheckpointError(f"{source} is not readable DCP metadata ({type(exc).__name__})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{source} holds a {type(md).__name__}, not DCP metadata")
    return md


class SafeReader(FileSystemReader):
    """DCP's filesystem reader, with ``.metadata`` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(str(self.path)) / ".metadata"
        md = safe_load_metadata(path.read_bytes(), str(path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_record(directory: Path, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """{name: {"size": bytes, "sha256": hex}} of every regular file in ``directory``."""
    out = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in exclude:
            out[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def damage(path: Path, share: int = 0, of: int = 1) -> str | None:
    """Why the checkpoint at ``path`` is damaged (this rank's share of the files), None if intact."""
    if not (path / META).is_file():
        return f"{META} is missing"
    try:
        meta = CheckpointMeta.from_file(path / META)
    except CheckpointError as exc:
        return str(exc)
    if not meta.files:
        return "it has no integrity record (written by an older autopar)"
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != meta.step:  # the newest is found by its name: a renamed one misleads
        return f"its directory is named for step {named.group(1)} but it holds step {meta.step} (renamed?)"
    if ".metadata" not in meta.files:
        return "its integrity record does not list .metadata"
    for i, (name, rec) in enumerate(sorted(meta.files.items())):
        if i % of != share:
            continue
        f = path / name
        if "/" in name or name in ("", ".", ".."):
            return f"its integrity record names {name!r}"
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != rec.get("size"):
            return f"{name} has {size} bytes, {rec.get('size')} were written"
        if sha256_file(f) != rec.get("sha256"):
            return f"{name} does not match its checksum (the bytes changed after the save)"
    return None


def candidates(directory: Path) -> list[Path]:
    """Checkpoint directories, newest first: the one ``latest`` names, then ``step-N`` by N."""
    out: list[Path] = []
    try:
        name = (directory / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if _STEP_DIR.match(name) and (directory / name).is_dir():
        out.append(directory / name)
    steps = sorted(((int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()),
                   reverse=True)
    out += [p for _, p in steps if p not in out]
    return out


def choose(directory: str | os.PathLike[str], warn: Callable[[str], None] | None = None,
           gather: Callable[[str | None], list[str | None]] | None = None, share: int = 0, of: int = 1) -> Path | None:
    """The newest intact checkpoint in ``directory`` (None when there are no checkpoints at all).

    Damaged newer ones are passed to ``warn`` (one line each). When every checkpoint is damaged,
    raises CheckpointError. ``gather`` (collective: every rank's verdict on its share) makes the
    ranks hash ``1/of`` of the files each and agree."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = candidates(d)
    if not found:
        return None
    reasons = []
    for path in found:
        mine = damage(path, share, of)
        verdicts = gather(mine) if gather is not None else [mine]
        why = next((v for v in verdicts if v), None)
        if why is None:
            return path
        reasons.append(f"{path.name}: {why}")
        if warn is not None and path != found[-1]:
            warn(f"checkpoint {path} is damaged ({why}); falling back to an older checkpoint")
    raise CheckpointError(f"no intact checkpoint in {d} ({'; '.join(reasons)[:400]}); use another --checkpoint-dir "
                          "or start without --resume")


def check_shapes(path: Path, metadata: Any, state: dict[str, Any]) -> None:
    """Every tensor of this rank's state dict that the checkpoint holds has the checkpoint's shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    held = metadata.state_dict_metadata
    for key, value in state.items():
        md = held.get(key)
        shape = getattr(value, "shape", None)
        if not isinstance(md, TensorStorageMetadata) or shape is None or key.startswith("rng/"):
            continue
        if tuple(md.size) != tuple(shape):
            raise CheckpointError(
                f"{path} holds {key} of shape {list(md.size)} but this model's is {list(shape)}: the checkpoint is of "
                "another model; use another --checkpoint-dir")
