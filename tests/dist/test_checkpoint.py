"""Issue 6 acceptance: checkpoint, resume and reshard (gloo on CPU, in the session's 4-rank spawn:
tests/dist/shared.py; a Job per action, in order, the checkpoints in the spawn's folder).

* Resume: 3 steps + checkpoint, then a fresh executable of the same plan resumes and runs steps 4-6:
  the losses equal the uninterrupted 6-step run of that plan (same plan: rel 1e-6).
* Reshard: the dp2 x tp2 checkpoint of step 3 resumes under pp2 x dp2 and under ZeRO-3 dp4 (and
  more layouts: ZeRO-1, FSDP2 x TP, interleaved pp with the tied embedding on two stages); every
  resumed run's losses equal the single-process 6-step reference (fp32, rel 1e-4, as the
  equivalence tests) and its final parameters equal the reference's.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import LR, SEED, Case
from shared import Job, result, share

pytestmark = pytest.mark.dist
STEPS = 6


@dataclass(frozen=True, kw_only=True)
class Action:
    """Train ``case`` up to ``steps`` total; resume from ``load`` and/or checkpoint into ``save``."""

    name: str
    case: Case
    steps: int
    load: str | None = None  # checkpoint directory name under the run's tmp dir
    save: str | None = None
    every: int = 1
    params: bool = False  # also record full final parameters
    tags: tuple[str, ...] = field(default_factory=tuple)


def _g(name: str, **par) -> Case:
    return Case(name=name, model="gpt", parallel=par, global_batch_size=8)


def _l(name: str, **par) -> Case:
    return Case(name=name, model="llama", parallel=par, global_batch_size=8)


DP2TP2 = _g("dp2xtp2", dp=2, tp=2, sequence_parallel=True)
ACTIONS = [
    Action(name="straight", case=DP2TP2, steps=STEPS),
    Action(name="first3", case=DP2TP2, steps=3, save="A", every=3),
    Action(name="resume-same", case=DP2TP2, steps=STEPS, load="A", params=True),
    Action(name="reshard-pp2xdp2", case=_g("pp2xdp2", pp=2, dp=2, pp_schedule="1f1b"), steps=STEPS, load="A", params=True),
    Action(name="reshard-zero3-dp4", case=_g("zero3", dp=4, zero=3), steps=STEPS, load="A", params=True),
    Action(name="reshard-zero1-dp4", case=_g("zero1", dp=4, zero=1), steps=STEPS, load="A"),
    Action(name="reshard-dp2xtp2-zero2", case=_g("fsdp-tp", dp=2, tp=2, zero=2), steps=STEPS, load="A"),
    # other direction: pipeline + tied embedding on two stages + permuted QKV -> flat ZeRO-1
    Action(name="first3-pp2xtp2", case=_g("pp2xtp2", pp=2, tp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2),
           steps=3, save="B", every=1),
    Action(name="reshard-B-zero1-dp4", case=_g("zero1b", dp=4, zero=1), steps=STEPS, load="B"),
    # Llama (GQA, no fused QKV) under FSDP2 x TP (2-D, strided shards) -> pp2 x dp2 ZeRO-3
    Action(name="first3-llama-fsdp-tp", case=_l("l-fsdp-tp", dp=2, tp=2, zero=2), steps=3, save="C", every=3),
    Action(name="reshard-C-pp2xdp2-zero3", case=_l("l-pp2xdp2", pp=2, dp=2, zero=3, pp_schedule="gpipe"),
           steps=STEPS, load="C"),
    # optimizer offload: the masters and moments live on the host (HostOptimizer); a checkpoint
    # carries them both ways, into and out of a plan without offload
    Action(name="reshard-A-zero1-dp4-offload", case=_g("zero1-off", dp=4, zero=1, offload={"optimizer": True}),
           steps=STEPS, load="A", params=True),
    Action(name="first3-offload", case=_g("pp2-dp2-off", pp=2, dp=2, zero=1, pp_schedule="1f1b",
                                            offload={"optimizer": True}), steps=3, save="D", every=3),
    Action(name="reshard-D-dp2xtp2", case=_g("dp2xtp2-d", dp=2, tp=2, sequence_parallel=True), steps=STEPS, load="D",
           params=True),
]


def _run(work_dir: Path, action: Action) -> dict | None:
    """Rank 0: the action's losses, first step and notes (and its final parameters)."""
    from autopar.executor.checkpoint.checkpoint import Checkpointer, find_latest, load
    from autopar.executor.parallel.apply import build_executable, full_parameters
    from autopar.executor.parallel.mesh import build_mesh
    from autopar.executor.runtime.checks import preflight
    from autopar.executor.runtime.train import StepHooks, train
    from autopar.modelfile import load_model_file

    root = work_dir / "checkpoint"
    if action.save:  # a respawn (harness.spawn_named) starts a half-written checkpoint over
        if dist.get_rank() == 0:
            shutil.rmtree(root / action.save, ignore_errors=True)
        dist.barrier()
    plan = action.case.plan()
    mf = load_model_file(plan.model.file)
    spec, _ = preflight(plan, mf, dist.get_world_size())
    mesh = build_mesh(plan, torch.device("cpu"))
    exe = build_executable(plan, mf, spec, mesh, seed=SEED, lr=LR, loss_fn=mf.loss_fn)
    start, history, notes = 0, [], []
    if action.load:
        latest = find_latest(root / action.load)
        assert latest is not None, f"no checkpoint in {action.load}"
        meta, notes = load(exe, latest)
        start, history = meta.step, list(meta.losses)
    hooks = None
    if action.save:
        ck = Checkpointer(directory=root / action.save, every=action.every, keep=2, seed=SEED, lr=LR)

        def after(done: int, loss: float) -> None:
            history.append(loss)
            if ck.due(done, action.steps):
                ck.save(exe, done, history)

        hooks = StepHooks(after_step=after)
    run = train(exe, mf, steps=action.steps, seed=SEED, start_step=start, hooks=hooks)
    out = {"losses": list(run.losses), "start": run.start_step, "notes": notes}
    if action.params:
        params = full_parameters(exe)
        c = mesh.coords
        mine = params if (c.dp, c.cp, c.tp) == (0, 0, 0) else None
        everything: list = [None] * dist.get_world_size()
        dist.all_gather_object(everything, mine)
        out["params"] = {k: v for d in everything if d for k, v in d.items()}
    return out if dist.get_rank() == 0 else None


def _listing(work_dir: Path) -> dict[str, list[str]]:
    """The directory protocol after all those saves."""
    return {d: sorted(p.name for p in (work_dir / "checkpoint" / d).iterdir()) for d in ("A", "B", "C")}


# a Job per action, in order, each after the action that saved the checkpoint it loads
_SAVER = {a.save: f"ckpt-{a.name}" for a in ACTIONS if a.save}
JOBS = {a.name: Job(name=f"ckpt-{a.name}", fn=_run, args=(a,), needs=(_SAVER[a.load],) if a.load else ())
        for a in ACTIONS}
LISTING = Job(name="ckpt-listing", fn=_listing, needs=tuple(JOBS[a.name].name for a in ACTIONS))
share(4, [*JOBS.values(), LISTING])


@functools.lru_cache(maxsize=None)
def _reference(model: str) -> tuple[list[float], dict]:
    from autopar.executor.runtime.train import run_reference
    from autopar.modelfile import load_model_file

    plan = (_g if model == "gpt" else _l)("ref").plan()
    torch.set_num_threads(2)
    losses, m = run_reference(load_model_file(plan.model.file), plan, steps=STEPS, seed=SEED, lr=LR)
    return losses, {n: p.detach().clone() for n, p in m.named_parameters(remove_duplicate=False)}


def _got(name: str) -> dict:
    got = result(4, JOBS[name])
    assert isinstance(got, list), f"{name} failed:\n{got}"
    return got[0]  # rank 0's


def test_resume_same_plan_equals_uninterrupted_run() -> None:
    straight, first, resumed = _got("straight"), _got("first3"), _got("resume-same")
    assert resumed["start"] == 3 and len(resumed["losses"]) == 3
    assert first["losses"] == pytest.approx(straight["losses"][:3], rel=1e-6)
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)
    ref, _ = _reference("gpt")
    assert straight["losses"] == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize("name", ["reshard-pp2xdp2", "reshard-zero3-dp4", "reshard-zero1-dp4", "reshard-dp2xtp2-zero2",
                                  "reshard-B-zero1-dp4", "reshard-C-pp2xdp2-zero3", "reshard-A-zero1-dp4-offload",
                                  "reshard-D-dp2xtp2"])
def test_reshard_equals_uninterrupted_run(name: str) -> None:
    got = _got(name)
    model = "llama" if "-C-" in name else "gpt"
    ref, ref_params = _reference(model)
    assert got["start"] == 3
    assert got["losses"] == pytest.approx(ref[3:], rel=1e-4), f"{name}: {got['losses']} vs {ref[3:]}"
    assert any("resharded" in n for n in got["notes"]), got["notes"]
    if "params" in got:
        assert set(got["params"]) == set(ref_params)
        for k, v in ref_params.items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} {k}: {m}")


def test_reshard_other_direction_first_run_matches() -> None:
    ref, _ = _reference("gpt")
    assert _got("first3-pp2xtp2")["losses"] == pytest.approx(ref[:3], rel=1e-4)


def test_checkpoint_directory_protocol() -> None:
    """keep=2 newest complete checkpoints, a ``latest`` pointer, no ``.tmp`` left behind."""
    listing = result(4, LISTING)
    assert isinstance(listing, list), f"listing failed:\n{listing}"
    listing = listing[0]
    assert listing["A"] == ["latest", "step-3"]
    assert listing["B"] == ["latest", "step-2", "step-3"]
    assert listing["C"] == ["latest", "step-3"]


# --- the directory protocol, without processes: a crash at any point of a save leaves a usable state


def _complete(d: Path, step: int) -> Path:
    from autopar.executor.checkpoint.checkpoint import CheckpointMeta
    from autopar.executor.checkpoint.integrity import file_record

    p = d / f"step-{step}"
    p.mkdir(parents=True)
    (p / ".metadata").write_bytes(b"x")
    (p / "__0_0.distcp").write_bytes(b"shard")
    meta = CheckpointMeta(step=step, seed=0, lr=1e-3, world_size=1, parallel={}, global_batch_size=4, num_blocks=4,
                          losses=(1.0,) * step, files=file_record(p))
    (p / "meta.json").write_text(meta.to_json())
    return p


def test_find_latest_ignores_partial_saves(tmp_path: Path) -> None:
    from autopar.executor.checkpoint.checkpoint import find_latest

    assert find_latest(tmp_path / "missing") is None
    assert find_latest(tmp_path) is None
    _complete(tmp_path, 2)
    (tmp_path / "latest").write_text("step-2\n")
    (tmp_path / "step-3.tmp").mkdir()  # crash during the shard writes of step 3
    (tmp_path / "step-3.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert find_latest(tmp_path).name == "step-2"
    (tmp_path / "step-4").mkdir()  # renamed but meta.json missing: cannot happen via publish(), still refused
    (tmp_path / "step-4" / ".metadata").write_bytes(b"x")
    assert find_latest(tmp_path).name == "step-2"
    _complete(tmp_path, 5)  # crash after the rename, before ``latest`` moved: latest still wins
    assert find_latest(tmp_path).name == "step-2"
    (tmp_path / "latest").write_text("garbage")  # a broken pointer: the newest complete step
    assert find_latest(tmp_path).name == "step-5"
    (tmp_path / "latest").unlink()
    assert find_latest(tmp_path).name == "step-5"


def test_publish_is_rename_then_pointer_and_keeps_n(tmp_path: Path) -> None:
    from autopar.executor.checkpoint.checkpoint import CheckpointMeta, find_latest, publish

    for step in (1, 2, 3):
        tmp = tmp_path / f"step-{step}.tmp"
        tmp.mkdir()
        (tmp / ".metadata").write_bytes(b"x")
        meta = CheckpointMeta(step=step, seed=0, lr=1e-3, world_size=1, parallel={}, global_batch_size=4,
                              num_blocks=4, losses=(0.5,) * step)
        publish(tmp, tmp_path / f"step-{step}", meta, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-3"]
    assert find_latest(tmp_path).name == "step-3"
    assert CheckpointMeta.from_file(tmp_path / "step-3" / "meta.json").losses == (0.5, 0.5, 0.5)


def test_resume_decision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar.executor.checkpoint.checkpoint import CheckpointError
    from autopar.executor.runtime.rank_main import resume_decision

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resume_decision(None, False).path is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resume_decision(str(tmp_path), True)
    _complete(tmp_path, 3)
    assert resume_decision(str(tmp_path), False).path is None  # a first attempt starts fresh
    assert resume_decision(str(tmp_path), True).path.name == "step-3"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart resumes by itself
    assert resume_decision(str(tmp_path), False).path.name == "step-3"
    # integrity: a newer checkpoint whose shard changed after the save is skipped, with one warning
    newer = _complete(tmp_path, 4)
    (newer / "__0_0.distcp").write_bytes(b"shard!")
    (tmp_path / "latest").write_text("step-4\n")
    warned: list[str] = []
    assert resume_decision(str(tmp_path), True, warn=warned.append).path.name == "step-3"
    assert len(warned) == 1 and "step-4 is damaged" in warned[0] and "__0_0.distcp has 6 bytes, 5 were written" in warned[0]
    (tmp_path / "step-3" / ".metadata").unlink()  # none intact: one line naming both
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step-4: .*step-3: \.metadata is missing"):
        resume_decision(str(tmp_path), True)
