"""The seed-built model is built once per node and mapped by its ranks (GPU readiness, B3).

Four gloo ranks stand for two nodes of two (``LOCAL_WORLD_SIZE`` 2, ``GROUP_RANK`` 0 and 1, as a
launcher sets them) and build a tp 2 x dp 2 ZeRO-1 plan of the tiny GPT: each rank's reference is
the file its node's first rank wrote, mapped (it appears in the rank's memory maps) rather than a
model the rank built; the weights every rank takes are the single-process model's; the files are
gone once the build returns. A node without room for the file builds a copy per rank, as before.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from harness import SEED, Case
from shared import Job, result, share

pytestmark = pytest.mark.dist

CASE = Case(name="gpt-tp2-dp2-zero1", model="gpt", parallel={"dp": 2, "tp": 2, "zero": 1, "sequence_parallel": True})


def _mapped_reference_files() -> list[str]:
    from autopar.executor.parallel.host_reference import FILE_PREFIX

    with open("/proc/self/maps", encoding="utf-8") as f:
        # the path, " (deleted)" once the node's first rank has unlinked it (the pages stay mapped)
        return sorted({line.split(None, 5)[-1].strip().removesuffix(" (deleted)") for line in f if FILE_PREFIX in line})


def _build(_work_dir, no_room: bool) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    # the ranks' processes run other modules' cases too: the node layout is set for this build only,
    # and earlier builds' mapped files (kept while a collectable cycle holds their model) let go
    gc.collect()
    launcher = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2))
    try:
        return _build_on_nodes(no_room)
    finally:
        for k, v in launcher.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _build_on_nodes(no_room: bool) -> dict:
    import torch.distributed as dist

    import autopar.executor.parallel.apply as apply_mod
    import autopar.executor.parallel.host_reference as host_ref
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.runtime.checks import preflight
    from autopar.modelfile import load_model_file

    plan = CASE.plan()
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    mesh = build_mesh(plan, torch.device("cpu"))
    seen: dict[str, object] = {}
    real_tensors, real_dir = apply_mod.reference_tensors, host_ref.file_dir

    def tensors(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real_tensors(*args, **kwargs)
        seen["mapped"] = _mapped_reference_files()
        return out

    apply_mod.reference_tensors = tensors
    if no_room:
        host_ref.file_dir = lambda nbytes: None
    try:
        exe = apply_mod.build_executable(plan, mf, spec, mesh, seed=SEED, lr=1e-3, loss_fn=mf.loss_fn)
    finally:
        apply_mod.reference_tensors, host_ref.file_dir = real_tensors, real_dir
    dist.barrier()
    seen["left"] = sorted(p.name for d in host_ref.file_dirs() if d.is_dir()
                          for p in d.glob(f"{host_ref.FILE_PREFIX}*"))
    seen["params"] = apply_mod.full_parameters(exe)
    return seen


# in the session's 4-rank spawn (tests/dist/shared.py): each job's result is the 4 ranks' records
JOBS = share(4, [Job(name=f"hostref-{kind}", fn=_build, args=(kind == "no-room",)) for kind in ("shared", "no-room")])


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    out = {}
    for job, kind in zip(JOBS, ("shared", "no-room")):
        ranks = result(4, job)
        assert isinstance(ranks, list), f"{job.name} failed:\n{ranks}"
        out.update({f"{kind}-{r}": got for r, got in enumerate(ranks)})
    return out


def test_every_rank_maps_its_nodes_file(results) -> None:
    names = {r: results[f"shared-{r}"]["mapped"] for r in range(4)}
    for r, mapped in names.items():
        assert len(mapped) == 1, (r, mapped)
    assert names[0] == names[1] and names[2] == names[3]  # one file per node ...
    assert names[0] != names[2] and "node0" in names[0][0] and "node1" in names[2][0]  # ... each its own


def test_no_file_is_left(results) -> None:
    for key, got in results.items():
        assert got["left"] == [], key


@pytest.mark.parametrize("kind", ["shared", "no-room"])
def test_weights_are_the_seed_models(results, kind: str) -> None:
    from autopar.executor.parallel.host_reference import build_reference
    from autopar.modelfile import load_model_file

    ref = dict(build_reference(load_model_file(CASE.plan().model.file), SEED).named_parameters(remove_duplicate=False))
    for r in range(4):
        got = results[f"{kind}-{r}"]["params"]
        assert set(got) == set(ref)
        for name, t in ref.items():
            assert torch.equal(got[name], t.detach()), (kind, r, name)
    assert all(results[f"no-room-{r}"]["mapped"] == [] for r in range(4))  # every rank built its own
