"""The seed-built weights every rank copies its part from: built once per node, shared by its ranks.

Every plan's weights equal the single-process model's for the same seed (executor/parallel/apply.py, step
4): each rank slices its shard out of a full model built on the host from ``torch.manual_seed(seed);
build_model()``. Built by every rank, that is one whole fp32 model per rank, 8 x 4 P bytes on a node
of 8 GPUs: 2.2 TB for a 70B model, above a DGX's 2 TB (GPU readiness, B3). Here the node's first
rank (its local rank 0) builds it once and writes its tensors to one file, in shared memory
(``/dev/shm``) where it has room, else in the temporary directory; every rank of the node maps that
file (``torch.load(mmap=True)``), so its pages are held once, in the page cache, however many ranks
read them. Once every rank has mapped it the file is unlinked; its pages go with the last mapping.

Coordination: rank 0 draws a token for the job's file names and broadcasts it; the node's ranks wait
for the file to appear (written under another name, then renamed into place) rather than in a
collective, so a build of many minutes cannot trip a communicator's timeout; a barrier once every
rank holds its mapping lets the leader unlink. Where neither place has room for the file, the
leader says so with a marker file and every rank builds its own copy, as before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.modelfile import ModelFile

SHARED_MEMORY = Path("/dev/shm")
FILE_PREFIX = "autopar-reference-"
HEADROOM = 1.05  # the file holds the tensors plus the archive's own records
POLL_S = 0.05


def build_reference(mf: ModelFile, seed: int) -> nn.Module:
    """The single-process model for ``seed``: what every plan's weights must equal."""
    torch.manual_seed(seed)
    return mf.build("cpu")


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name, tied names included (persistent or not:
    a state dict would drop the non-persistent buffers, which a rank fills too)."""
    out = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b.detach() for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def local_world() -> tuple[int, int, int]:
    """(local rank, ranks on this node, node index) as the launcher (torchrun, autopar's) sets them."""
    local_size = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    node = int(os.environ.get("GROUP_RANK", str(rank // local_size)) or 0)
    return local_rank, local_size, node


def host_copies() -> int:
    """Whole models the node holds at once while its ranks take their parts: the one the node's
    first rank builds, and the shared file it writes from it when more ranks run there."""
    return 1 if local_world()[1] == 1 else 2


def file_dirs() -> tuple[Path, Path]:
    """Where a node's file may go, in order of preference: shared memory, the temporary directory."""
    return SHARED_MEMORY, Path(tempfile.gettempdir())


def file_dir(nbytes: int) -> Path | None:
    """The first of ``file_dirs`` with room for ``nbytes`` (None: neither)."""
    for d in file_dirs():
        try:
            if d.is_dir() and os.access(d, os.W_OK) and shutil.disk_usage(d).free >= nbytes * HEADROOM:
                return d
        except OSError:
            continue
    return None


def reference_tensors(mf: ModelFile, seed: int, *, wait_s: float = 3600.0) -> Mapping[str, torch.Tensor]:
    """The seed-built model's tensors by name (``model_tensors``), built once per node and shared
    by its ranks when more than one runs there (module docstring), else built here. Collective
    when ``LOCAL_WORLD_SIZE`` > 1: every rank of the job calls it."""
    local_rank, local_size, node = local_world()
    if local_size == 1 or not dist.is_initialized():
        return model_tensors(build_reference(mf, seed))
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token)
    name = f"{FILE_PREFIX}{token[0]}-node{node}"
    marker = Path(tempfile.gettempdir()) / f"{name}.none"
    places = [d / f"{name}.pt" for d in file_dirs()]
    if local_rank == 0:
        model = build_reference(mf, seed)
        tensors = model_tensors(model)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
        where = file_dir(sum(storages.values()))
        if where is None:  # no room to share: every rank builds its own
            marker.touch()
            path = None
        else:
            path = where / f"{name}.pt"
            partial = path.with_suffix(".part")
            try:
                torch.save(tensors, partial)
                os.replace(partial, path)
            finally:
                partial.unlink(missing_ok=True)
            del model, tensors
    else:
        path = _wait_for(places, marker, wait_s)
    shared = None if path is None else torch.load(path, mmap=True, weights_only=True)
    dist.barrier()  # every rank of the node holds its mapping (or knows to build): the names can go
    if local_rank == 0:
        for p in [*places, marker]:
            p.unlink(missing_ok=True)
    if shared is None:
        return model_tensors(build_reference(mf, seed)) if local_rank != 0 else tensors
    return shared


def _wait_for(places: list[Path], marker: Path, wait_s: float) -> Path | None:
    """The shared file once the node's first rank has renamed it into place; None when it left the
    no-room marker instead."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for p in places:
            if p.is_file():
                return p
        if marker.is_file():
            return None
        time.sleep(POLL_S)
    raise AutoparError(f"the node's first rank did not build the model within {wait_s:,.0f} s "
                       "(it writes the seed-built weights its node's ranks share): see its log")
