"""Sharded, plan-independent, atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``DIR`` (a filesystem every rank sees -- one node, or a shared filesystem)::

    DIR/step-6/           a complete checkpoint: DCP shards (``__<rank>_0.distcp``), ``.metadata``,
                          and ``meta.json`` (step, seed, lr, plan, loss history) written last
    DIR/step-9.tmp/       a save in progress (or one that crashed): never read
    DIR/latest            one line, ``step-6``: replaced atomically (temp + rename)

Save protocol (collective): rank 0 clears a stale ``step-N.tmp``; every rank writes its shards with
``dcp.save`` into ``step-N.tmp`` (DCP's coordinator writes ``.metadata`` only after every rank
reported); barrier; rank 0 records the size and sha256 of every file (``meta.json``'s ``files``),
writes ``meta.json``, fsyncs, renames ``step-N.tmp`` -> ``step-N`` and only then replaces
``latest``; barrier. A crash at any point leaves ``latest`` naming a complete checkpoint (or
absent), so resume never sees half a save.

Load protocol (integrity.py): the candidates, newest first, are checked against their recorded
sizes and checksums (the ranks share the hashing); a damaged one is skipped with a one-line
warning, and none intact is a one-line error. DCP's ``.metadata`` is a pickle: it is read with a
restricted unpickler that builds only DCP's metadata classes (``SafeReader``), so a crafted
checkpoint cannot run code -- the checksum alone would not protect it, since whoever can rewrite
``.metadata`` can rewrite ``meta.json`` too. The tensors are read by DCP with
``torch.load(weights_only=True)``.

Plan independence (what makes *reshard* work): every entry is keyed by the parameter's
fully-qualified name in the user's full model -- wrapper prefixes (DDP ``module.``, the pipeline
``StageModule``'s ``autopar_chunk.``, apply.original_name) removed and tied aliases (GPT's ``output.weight`` on the last pipeline
stage = ``tok_embeddings.weight``) mapped to one canonical name. Values are the live parameters and
AdamW moments: DTensors (TP, FSDP2, FSDP2 x TP) keep their shards and DCP records their global
offsets, plain tensors (DDP, replicated) are deduplicated by DCP; on load DCP reads whatever slice
each rank's new layout needs. Two exceptions are handled here: fused QKV weights under tp > 1 are
stored row-permuted (tensor_parallel.py), so they and their moments are gathered, un-permuted and
saved whole (load: read whole, permute, keep the local shard) -- whole copies held on the host, one
gathered on the device at a time (every layer's fused weight and moments whole at once would not fit
a GPU beside the model); ZeRO-1 (ZeroRedundancyOptimizer)
keeps each parameter's state on one rank only, which DCP handles as a key present on one rank.

The ``torch.distributed.checkpoint.state_dict`` helpers (get/set_state_dict) are not used: they take
one module and one optimizer over it, while a pipeline rank holds several chunks under one optimizer,
and they know neither ZeroRedundancyOptimizer nor the permuted QKV rows. This module builds the same
flat FQN-keyed state dict (``model/<fqn>``, ``optim/<fqn>/<state>``) itself and lets DCP reshard.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from autopar.errors import AutoparError
from autopar.executor.checkpoint.checkpoint_meta import (  # noqa: F401  (re-exported: the checkpoint's names)
    FORMAT,
    LATEST,
    MAX_META_BYTES,
    META,
    CheckpointError,
    CheckpointMeta,
)
from autopar.executor.parallel.apply import Executable, original_name
from autopar.executor.parallel.full_value import full_tensor
from autopar.executor.parallel.offload import HOST, HostOptimizer

_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------
# Directory protocol (pure filesystem; rank 0 only where it writes)


def is_complete(path: Path) -> bool:
    """A checkpoint is complete once DCP's ``.metadata`` and our ``meta.json`` both exist."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def find_latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint: ``latest`` when it names a complete one, else the highest
    complete ``step-N`` (a crash between rename and pointer update); None when there is none."""
    d = Path(directory)
    if not d.is_dir():
        return None
    try:
        name = (d / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        name = ""
    if _STEP_DIR.match(name) and is_complete(d / name):
        return d / name
    steps = sorted(
        (int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)
    )
    return steps[-1][1] if steps else None


LOCK = ".autopar.lock"


def lock_directory(directory: str | os.PathLike[str]):  # noqa: ANN201 - an open file object
    """Take the exclusive lock of a checkpoint directory (``DIR/.autopar.lock``, ``flock``) for as
    long as the returned file stays open; a second run on the same directory gets a one-line
    CheckpointError naming the holder's pid instead of overwriting its checkpoints. (flock is
    advisory and, on some network filesystems, local to one host.)"""
    import fcntl

    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fh = open(d / LOCK, "a+", encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {d}: cannot create its lock file: {exc.strerror}") from None
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise CheckpointError(f"--checkpoint-dir {d} is in use by another autopar run (pid {holder}); wait for it "
                              "to finish or use another directory") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def publish(tmp: Path, final: Path, meta: CheckpointMeta, keep: int) -> None:
    """Rank 0, after every rank's shards are written: integrity record + meta.json, rename,
    ``latest``, retention."""
    import dataclasses

    from autopar.executor.checkpoint.integrity import file_record

    meta = dataclasses.replace(meta, files=file_record(tmp, exclude=(META,)))
    _write_file_atomic(tmp / META, meta.to_json())
    if final.exists():  # left by a crash after rename but before ``latest`` moved on; not referenced
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    _write_file_atomic(final.parent / LATEST, final.name + "\n")
    if keep > 0:
        done = sorted((int(m.group(1)), p) for p in final.parent.iterdir() if (m := _STEP_DIR.match(p.name)))
        for _, old in done[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        for p in final.parent.glob("step-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The FQN-keyed state dict


@dataclass(frozen=True, kw_only=True)
class _Gathered:
    """A permuted (fused-QKV) tensor saved whole: ``target`` is the live (sharded) tensor."""

    key: str
    target: torch.Tensor
    perm: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class _Alias:
    """Another local copy of a shared parameter (or of its optimizer state): an interleaved pipeline
    rank holds one per chunk under the same name. DCP loads the first copy (``source``); this one
    is copied from it after the load (the copies are equal by construction: their gradients are
    summed, pipeline_parallel.sync_tied_grads)."""

    key: str
    source: torch.Tensor
    target: torch.Tensor


def _optimizer_state(exe: Executable, p: torch.Tensor) -> dict[str, Any] | None:
    opt = exe.optimizer
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer: this rank's shard only
    state = inner.state if inner is not None and hasattr(opt, "_partition_parameters") else opt.state
    return state.get(p)


def _shaped_as(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a host tensor of ``p``'s local shape: its master or a state) laid out as ``p``: a
    DTensor with ``p``'s mesh and placements when ``p`` is one, sharing ``local``'s storage so a load
    writes into it. Built as FSDP2 builds its host-offloaded shards (``DTensor.from_local`` would
    move a host tensor to the mesh's device)."""
    if not isinstance(p, DTensor):
        return local
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(p.device_mesh, tuple(p.placements),
                       tensor_meta=TensorMeta(p.shape, p.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _local_params(exe: Executable) -> list[tuple[str, str, torch.Tensor]]:
    """(canonical name, original name, parameter) of every distinct local parameter."""
    seen: set[int] = set()
    out = []
    for part in exe.parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            orig = original_name(name, part)
            out.append((exe.canonical_names.get(orig, orig), orig, p))
    return out


def _full_unpermuted(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The whole, un-permuted value of ``t`` on the host (collective over its mesh). Gathered on the
    mesh's device (a host master, optimizer offload, too: full_value.py) and moved to the host at
    once: the state dict holds every layer's whole fused weight and moments until DCP writes them."""
    full = full_tensor(t).detach().to(HOST)
    return full[torch.argsort(perm.to(HOST))]


def build_state(exe: Executable, *, rng: bool, for_load: bool) -> tuple[dict[str, Any], list[_Gathered | _Alias]]:
    """The flat DCP state dict of this rank (collective when fused-QKV tensors are gathered).

    Keys: ``model/<fqn>``, ``buffer/<fqn>``, ``optim/<fqn>/<name>``, ``rng/rank<r>/cpu``.
    ``for_load``: permuted entries are empty full-size placeholders, returned as fix-ups; a second
    local copy of a key (an interleaved rank's shared parameter) is an ``_Alias`` fix-up (saving
    writes the first copy once).
    """
    state: dict[str, Any] = {}
    fixups: list[_Gathered | _Alias] = []
    first: dict[str, torch.Tensor] = {}  # key -> the live tensor of its first local copy

    def put(key: str, value: torch.Tensor, perm: torch.Tensor | None) -> None:
        if key in first:
            if for_load and first[key] is not value:
                fixups.append(_Alias(key=key, source=first[key], target=value))
            return
        first[key] = value
        if perm is None:
            state[key] = value
            return
        if for_load:  # on the host, as saved (_full_unpermuted); _apply_fixup takes each to the device
            holder = torch.empty(tuple(value.shape), dtype=value.dtype, device=HOST)
            state[key] = holder
            fixups.append(_Gathered(key=key, target=value, perm=perm))
        else:
            state[key] = _full_unpermuted(value, perm)

    host = exe.optimizer if isinstance(exe.optimizer, HostOptimizer) else None
    for canon, orig, p in _local_params(exe):
        perm = exe.permutations.get(orig)
        copy = host.host_copy(p) if host is not None else None
        if copy is not None:  # optimizer offload: the fp32 master on the host is the parameter's value
            put(f"model/{canon}", _shaped_as(p, copy[0]), perm)
            st = {k: _shaped_as(p, v) if isinstance(v, torch.Tensor) and v.shape == copy[0].shape else v
                  for k, v in copy[1].items()}
        else:
            put(f"model/{canon}", p, perm)
            st = _optimizer_state(exe, p)
        for sname, value in sorted((st or {}).items()):
            if isinstance(value, torch.Tensor):
                same = tuple(value.shape) == tuple(p.shape)
                put(f"optim/{canon}/{sname}", value, perm if same else None)
    for part in exe.parts:
        for name, buf in part.named_buffers():
            owner, _, leaf = name.rpartition(".")
            module = part.get_submodule(owner) if owner else part
            if leaf not in module._non_persistent_buffers_set:
                orig = original_name(name, part)
                put(f"buffer/{exe.canonical_names.get(orig, orig)}", buf, None)
    if rng:
        r = dist.get_rank()
        state[f"rng/rank{r}/cpu"] = torch.empty_like(torch.get_rng_state()) if for_load else torch.get_rng_state()
        if exe.mesh.device.type == "cuda":
            cur = torch.cuda.get_rng_state(exe.mesh.device)
            state[f"rng/rank{r}/cuda"] = torch.empty_like(cur) if for_load else cur
    return state, fixups


def _apply_alias(fix: _Alias) -> None:
    src, dst = fix.source, fix.target
    with torch.no_grad():
        if isinstance(dst, DTensor):
            if not isinstance(src, DTensor) or tuple(src.placements) != tuple(dst.placements):
                raise CheckpointError(f"cannot restore the second local copy of {fix.key}: its layout differs from the first's")
            dst.to_local().copy_(src.to_local())
        else:
            dst.copy_(full_tensor(src))  # a host master's shard is gathered from the mesh's device


def _apply_fixup(fix: _Gathered, loaded: torch.Tensor) -> None:
    full = loaded[fix.perm.to(loaded.device)]
    with torch.no_grad():
        if isinstance(fix.target, DTensor):
            mesh = fix.target.device_mesh
            rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
            fix.target.to_local().copy_(rep.redistribute(mesh, fix.target.placements).to_local())
        else:
            fix.target.copy_(full)


def init_optimizer_state(exe: Executable) -> None:
    """Create the optimizer's state tensors (zero gradients, lr 0) so DCP has targets to load into.
    Collective: ZeRO-1 broadcasts its updated shards. AdamW with lr 0 leaves the weights unchanged."""
    opt = exe.optimizer
    # HostOptimizer: its groups hold the host masters; the step reads the device gradients
    params = opt.device_params if isinstance(opt, HostOptimizer) else [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    inner = getattr(opt, "optim", None)
    if inner is not None:
        for g in inner.param_groups:
            g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    if inner is not None:
        for g in inner.param_groups:
            g["lr"] = lrs[0]
    opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# Save / load (collective)


@dataclass(frozen=True, kw_only=True)
class Checkpointer:
    """Saves every ``every`` steps into ``directory`` (and at the last step); ``keep`` newest kept."""

    directory: Path
    every: int
    keep: int
    seed: int
    lr: float

    def due(self, steps_done: int, total: int) -> bool:
        return steps_done == total or (self.every > 0 and steps_done % self.every == 0)

    def save(self, exe: Executable, steps_done: int, losses: list[float],
             before_publish: Callable[[], None] | None = None) -> Path:
        """Write ``step-<steps_done>`` atomically (see module docstring). Collective."""
        import torch.distributed.checkpoint as dcp

        final = self.directory / f"step-{steps_done}"
        tmp = self.directory / f"step-{steps_done}.tmp"
        if dist.get_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        dist.barrier()
        state, _ = build_state(exe, rng=True, for_load=False)
        try:
            dcp.save(state, checkpoint_id=str(tmp))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException (a BaseException) gathers every rank's
            if _is_peer_loss(exc):
                raise
            raise CheckpointError(f"cannot write checkpoint {tmp}: {failure_line(exc)}; {LATEST} still names the "
                                  "previous one"[:600]) from None
        dist.barrier()  # every rank's shards are on disk
        if before_publish is not None:
            before_publish()
        failure: list[str | None] = [None]
        if dist.get_rank() == 0:
            plan = exe.plan
            meta = CheckpointMeta(
                step=steps_done, seed=self.seed, lr=self.lr, world_size=dist.get_world_size(),
                parallel=_parallel_dict(plan), global_batch_size=plan.training.global_batch_size,
                num_blocks=plan.model.num_blocks, losses=tuple(losses),
            )
            try:
                publish(tmp, final, meta, self.keep)
            except OSError as exc:  # e.g. a full disk: tell every rank instead of leaving them in a barrier
                failure[0] = f"cannot publish checkpoint {final}: {exc.strerror or exc}; {LATEST} still names the previous one"
        dist.broadcast_object_list(failure, src=0)
        if failure[0]:
            raise CheckpointError(failure[0])
        return final


def _is_peer_loss(exc: BaseException) -> bool:
    """A DCP failure caused by a dead or hung peer (left to the fault handling, exit 4)."""
    text = str(exc)
    return any(t in text for t in ("imed out", "Connection closed", "Connection reset", "Broken pipe"))


def _parallel_dict(plan) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(plan.parallel)
    d["stages"] = [list(r) for r in plan.stage_ranges()] if plan.parallel.stages is not None else None
    return d


def load(exe: Executable, path: Path) -> tuple[CheckpointMeta, list[str]]:
    """Restore model, optimizer, buffers (and RNG when the plan is unchanged) from ``path``.
    Collective. Returns the checkpoint's record and notes for the log."""
    import torch.distributed.checkpoint as dcp

    meta = CheckpointMeta.from_file(path / META)
    notes: list[str] = []
    same_layout = meta.world_size == dist.get_world_size() and meta.parallel == _parallel_dict(exe.plan)
    if not same_layout:
        notes.append(f"resharded {path.name} from {_describe(meta.parallel)} to {_describe(_parallel_dict(exe.plan))}"
                     " (per-rank RNG state not restored)")
    from autopar.executor.checkpoint.integrity import SafeReader, check_shapes

    init_optimizer_state(exe)
    state, fixups = build_state(exe, rng=same_layout, for_load=True)
    reader = SafeReader(str(path))
    check_shapes(path, reader.read_metadata(), state)
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)))
    except (KeyboardInterrupt, SystemExit):
        raise
    except AutoparError:
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise CheckpointError(f"cannot load {path}: {failure_line(exc)}"[:600]) from None
    for fix in fixups:  # un-permute first: an alias may copy from a permuted tensor's live target
        if isinstance(fix, _Gathered):
            _apply_fixup(fix, state[fix.key])
    for fix in fixups:
        if isinstance(fix, _Alias):
            _apply_alias(fix)
    if isinstance(exe.optimizer, HostOptimizer):  # optimizer offload: the loaded masters go up
        exe.optimizer.push_masters()
    r = dist.get_rank()
    if same_layout:
        torch.set_rng_state(state[f"rng/rank{r}/cpu"])
        if f"rng/rank{r}/cuda" in state:
            torch.cuda.set_rng_state(state[f"rng/rank{r}/cuda"], exe.mesh.device)
    return meta, notes


def failure_line(exc: BaseException) -> str:
    """What went wrong in a DCP save or load, in a few words: each rank's own exception (DCP gathers
    them into a CheckpointException whose text begins "CheckpointException ranks:dict_keys([0, 1])"),
    an OSError by its cause ("No space left on device"), the ranks that met each."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return _cause(exc)
    ranks: dict[str, list[int]] = {}
    for rank, failure in sorted(failures.items()):
        ranks.setdefault(_cause(failure[0] if isinstance(failure, tuple) else failure), []).append(rank)
    return "; ".join(f"{cause} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for cause, r in ranks.items())


def _cause(exc: BaseException) -> str:
    """An OSError's cause anywhere in ``exc``'s chain, else its first line."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError) and link.strerror:
            return link.strerror
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _describe(par: dict[str, Any]) -> str:
    axes = [f"{k}{par.get(k, 1)}" for k in ("pp", "dp", "cp", "tp") if par.get(k, 1) > 1] or ["1 rank"]
    return "x".join(axes) + f" zero{par.get('zero', 0)}"
