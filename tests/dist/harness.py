"""Spawn helpers for the distributed equivalence tests (gloo on CPU).

One spawn per world size runs many plan cases in sequence (process start costs seconds, docs/design.md §9).
Rank 0 of each case saves ``{case}.pt`` = {"losses": [...], "params": {name: full tensor}} into a
result directory; the test process compares them with ``run_reference`` of the same seed and data.
A case that raises aborts the whole spawn (its peers would otherwise wait in a collective); the
cases already finished keep their results and the rest report the error. The test modules share
one spawn per world size for the whole session through tests/dist/shared.py (``share``, ``result``),
which runs on these pieces; ``spawn_cases`` is a module's own spawn.

``AUTOPAR_TEST_BACKEND=nccl`` runs the same cases on NCCL, one GPU per rank (a machine with at least
the world size in GPUs): the ranks train on ``cuda:<rank>`` and their results come back on the host,
compared with the same single-process CPU reference. The default is gloo on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.plan import plan_from_dict

HERE = Path(__file__).resolve().parent
ZOO = HERE.parents[1] / "examples" / "zoo"  # the model zoo's files, at their tiny size
MODELS = {
    "gpt": HERE / "models" / "tiny_gpt.py",
    "llama": HERE / "models" / "tiny_llama.py",
    "gpt-gather-loss": HERE / "models" / "tiny_gpt_gather_loss.py",  # a loss_fn that cannot take DTensor logits
    "mlp": HERE.parents[1] / "examples" / "mlp.py",
    "strided": HERE / "models" / "strided_blocks.py",  # blocks return a non-contiguous view
}
BLOCKS = {"gpt": 4, "llama": 4, "mlp": 12, "gpt-gather-loss": 4, "strided": 4}
SEQ = {"gpt": 32, "llama": 32, "mlp": 1, "gpt-gather-loss": 32, "strided": 16}
STEPS, SEED, LR = 3, 1234, 1e-3


@dataclass(frozen=True, kw_only=True)
class Case:
    """A named plan for one model: ``parallel`` keys as in the plan YAML."""

    name: str
    model: str
    parallel: dict[str, Any] = field(default_factory=dict)
    global_batch_size: int = 4
    micro_batch_size: int = 1

    def plan_dict(self) -> dict[str, Any]:
        par = {"dp": 1, "tp": 1, "pp": 1, **self.parallel}
        n = par["dp"] * par["tp"] * par["pp"] * par.get("cp", 1)
        return {
            "version": 1,
            "model": {"file": str(MODELS[self.model]), "num_blocks": BLOCKS[self.model]},
            "cluster": {"profile": "a100-80g", "num_gpus": n, "gpus_per_node": 8},
            "training": {
                "global_batch_size": self.global_batch_size,
                "micro_batch_size": self.micro_batch_size,
                "seq_len": SEQ[self.model],
                "dtype": "fp32",
                "optimizer": "adamw",
            },
            "parallel": par,
        }

    def plan(self):
        return plan_from_dict(self.plan_dict())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_case(case: Case, out_dir: Path) -> None:
    from autopar.executor.parallel.apply import build_executable, full_parameters
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.runtime.checks import preflight
    from autopar.executor.runtime.train import train
    from autopar.modelfile import load_model_file

    plan = case.plan()
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    mesh = build_mesh(plan, test_device())
    exe = build_executable(plan, mf, spec, mesh, seed=SEED, lr=LR, loss_fn=mf.loss_fn)
    first_grads: dict[str, torch.Tensor] = {}

    def grab(step: int) -> None:
        if step == 0:
            first_grads.update(_on_host(full_parameters(exe, grads=True)))

    vocab_sharded = tp_vocab_sharded(exe)
    result = train(exe, mf, steps=STEPS, seed=SEED, on_grads=grab)
    params = _on_host(full_parameters(exe))
    c = mesh.coords
    mine = (params, first_grads, vocab_sharded) if (c.dp, c.cp, c.tp) == (0, 0, 0) else None
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if dist.get_rank() == 0:
        merged: dict[str, torch.Tensor] = {}
        grads: dict[str, torch.Tensor] = {}
        sharded: set[str] = set()
        for d in everything:
            if d:
                merged.update(d[0])
                grads.update(d[1])
                sharded.update(d[2])
        torch.save(
            {"losses": list(result.losses), "params": merged, "grads": grads, "notes": list(result.notes),
             "vocab_sharded": sorted(sharded)},
            out_dir / f"{case.name}.pt",
        )
    dist.barrier()


def tp_vocab_sharded(exe) -> list[str]:
    """Names (full-model, tied aliases included) of this rank's parameters of the token embedding
    and output head that are sharded by vocabulary (dim 0) over the tp mesh dimension."""
    from torch.distributed.tensor import DTensor, Shard

    from autopar.executor.parallel.apply import original_name

    spec, out = exe.spec, []
    edges = {f"{m}.weight" for m in (spec.vocab_embedding, spec.vocab_head) if m}
    for part in exe.parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            if original_name(name, part) not in edges or not isinstance(p, DTensor):
                continue
            dims = p.device_mesh.mesh_dim_names or ()
            if "tp" in dims and p.placements[dims.index("tp")] == Shard(0):
                out.append(original_name(name, part))
    return out


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """One spawned rank of a gloo process group on this host (one thread, as the runs have), destroyed
    on the way out whatever happens (docs/design.md: teardown without it is flaky on gloo). When the
    body returns, the process leaves at once (``leave_rank``): nothing may follow the ``with``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    device = test_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
    leave_rank()


def test_device(rank: int | None = None) -> torch.device:
    """Where a spawned rank trains: ``cuda:<rank>`` under ``AUTOPAR_TEST_BACKEND=nccl``, else the CPU."""
    if os.environ.get("AUTOPAR_TEST_BACKEND", "gloo") == "nccl":
        return torch.device("cuda", dist.get_rank() if rank is None else rank)
    return torch.device("cpu")


def _on_host(x: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, x)


def leave_rank() -> None:
    """End a spawned rank whose work is done and whose process group is destroyed, skipping the
    interpreter's teardown: there a native thread of the distributed stack (left by FSDP2's and the
    functional collectives' async work) is now and then destroyed while still joinable -- "terminate
    called without an active exception", SIGABRT, about 1 spawn in 10 of the comm profile here -- and
    mp.spawn fails a rank that had succeeded (as ``autopar.commands.main.exit_process`` does under torchrun)."""
    from autopar.commands.main import leave_process

    leave_process(0)


def spawn_again_on_abort(worker: Callable[..., None], world: int, *args: Any) -> None:
    """``mp.spawn(worker, args=(world, port, *args), nprocs=world)``, spawned once more (on a new
    port) when a rank died by a signal rather than a Python error: a native abort in the gloo stack
    (glibc's heap check, a joinable thread destroyed) seen now and then on shared CPUs. The worker
    must be safe to rerun whole; a Python error, or a second abort, is raised."""
    try:
        mp.spawn(worker, args=(world, _free_port(), *args), nprocs=world, join=True)
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        mp.spawn(worker, args=(world, _free_port(), *args), nprocs=world, join=True)


def _worker(rank: int, world: int, port: int, cases: list[Case], out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        for case in cases:
            try:
                _run_case(case, Path(out_dir))
            except BaseException:
                (Path(out_dir) / f"{case.name}.err").write_text(traceback.format_exc())
                raise


def spawn_cases(world: int, cases: list[Case]) -> dict[str, Any]:
    """Run ``cases`` on ``world`` gloo ranks; returns {case name: result dict or error string}."""
    with tempfile.TemporaryDirectory(prefix=f"autopar-dist{world}-") as out_dir:
        return _spawn_cases_in(world, cases, out_dir)


def _spawn_cases_in(world: int, cases: list[Case], out_dir: str) -> dict[str, Any]:
    return spawn_named(_worker, world, cases, out_dir)


def spawn_named(worker: Callable[..., None], world: int, items: list[Any], out_dir: str,
                prepare: Callable[[list[Any]], None] | None = None, keep_going: bool = False) -> dict[str, Any]:
    """``mp.spawn(worker, args=(world, port, todo, out_dir))`` over named ``items`` (each ``.name``),
    whose worker saves ``{name}.pt`` (rank 0) or ``{name}.err`` per item in ``out_dir``; returns
    {name: the loaded result, or the error text}. A second spawn runs only the items without a
    result, and only when the first died without a Python error (a native abort in gloo, seen
    rarely here and once in CI). ``keep_going``: after a Python error too, spawned again with the
    items after the failed one (each such spawn ends at least one item). ``prepare(todo)`` runs
    before each spawn (e.g. to start a half-written output over)."""
    error = None
    todo = list(items)
    aborts = 0
    while todo:
        if prepare is not None:
            prepare(todo)
        try:
            mp.spawn(worker, args=(world, _free_port(), todo, out_dir), nprocs=world, join=True)
            break
        except Exception as exc:  # noqa: BLE001 - reported per item below
            error = f"spawn failed: {exc}"
            failed = any((Path(out_dir) / f"{i.name}.err").exists() for i in todo)
            if failed and not keep_going:
                break
            aborts += not failed
            if aborts > 1:
                break
            todo = [i for i in todo if not any((Path(out_dir) / f"{i.name}{e}").exists() for e in (".pt", ".err"))]
    results: dict[str, Any] = {}
    for item in items:
        ok, err = Path(out_dir) / f"{item.name}.pt", Path(out_dir) / f"{item.name}.err"
        if ok.exists():
            results[item.name] = torch.load(ok, weights_only=False)
        elif err.exists():
            results[item.name] = err.read_text()
        else:
            results[item.name] = error or "did not run"
    return results


def _reference_key(case: Case) -> str:
    """What a single-process run depends on: the model file and the training section (batch,
    micro-batch, dtype, optimizer); the parallel layout and the cluster do not enter it."""
    d = case.plan_dict()
    return json.dumps({"model": d["model"], "training": d["training"]}, sort_keys=True, default=str)


_REFERENCES: dict[str, Any] = {}  # _reference_key -> reference_for's answer, for the session


def _reference(case: Case):
    import torch

    from autopar.executor.runtime.train import run_reference
    from autopar.modelfile import load_model_file

    plan = dataclasses.replace(case, name="ref", parallel={}).plan()
    mf = load_model_file(plan.model.file)
    torch.set_num_threads(2)
    grads: dict = {}

    def grab(step, model):
        if step == 0:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
                          if p.grad is not None})

    losses, model_ = run_reference(mf, plan, steps=STEPS, seed=SEED, lr=LR, on_grads=grab)
    params = {n: p.detach().clone() for n, p in model_.named_parameters(remove_duplicate=False)}
    return losses, params, grads


def reference_for(case: Case):
    """(losses, parameters after the steps, first-step gradients) of ``case``'s model trained as one
    process (its Case subclass says where the model file is and how it trains), computed once per
    model file and training section for the session, whichever module's Case asks."""
    key = _reference_key(case)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(case)
    return _REFERENCES[key]
