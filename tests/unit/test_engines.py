"""Plans for the engines users run (autopar/engines): export then read back gives the same plan; what an
engine cannot express is refused with one line; the engines' own parsers accept what is exported;
Megatron-LM flags of the published Megatron runs reproduce the calibration's predictions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autopar import api
from autopar.engines import EXPORT_ENGINES, export_config, get_engine, plan_reason, read_config
from autopar.engines.capability import ENGINES, search_knobs
from autopar.engines.config import to_plan
from autopar.errors import AutoparError
from autopar.plan import ClusterRef, ModelRef, Offload, Parallel, Plan, Training

REPO = Path(__file__).resolve().parents[2]
MEGATRON_RUNS = REPO / "tests" / "data" / "engines" / "megatron"


def _plan(blocks: int = 32, gpus: int = 64, gbs: int = 256, mbs: int = 2, seq: int = 4096, dtype: str = "bf16",
          **par: object) -> Plan:
    return Plan(model=ModelRef(file="model.py", num_blocks=blocks, sha256="0" * 64),
                cluster=ClusterRef(profile="h100-80g", num_gpus=gpus, gpus_per_node=8),
                training=Training(global_batch_size=gbs, micro_batch_size=mbs, seq_len=seq, dtype=dtype),
                parallel=Parallel(**par))


# Per engine, plans that use each feature it can express.
ROUND_TRIPS = {
    "megatron": [
        _plan(dp=8, tp=8, sequence_parallel=True, zero=1),
        _plan(dp=2, tp=8, pp=4, sequence_parallel=True, zero=1, recompute="selective"),
        _plan(dp=2, tp=4, pp=8, sequence_parallel=True, zero=1, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
              gbs=512),
        _plan(dp=4, tp=4, pp=4, zero=1, stages=((0, 7), (7, 16), (16, 25), (25, 32)), recompute="full"),
        _plan(dp=4, tp=4, pp=4, zero=1, recompute_blocks=((5, 0, 3), (5, 0, 3), (5, 0, 3), (5, 0, 3))),
        _plan(dp=8, tp=4, cp=2, cp_kind="allgather", sequence_parallel=True, zero=1),
        _plan(dp=4, tp=8, cp=2, cp_kind="ulysses", zero=0, gbs=64, mbs=1),
        _plan(dp=16, tp=2, cp=2, zero=3, ep=8),
        _plan(dp=64, zero=2, dtype="fp16"),
        _plan(dp=8, tp=8, zero=1, offload=Offload(optimizer=True)),
    ],
    "torchtitan": [
        _plan(dp=64, zero=3, recompute="op"),
        _plan(dp=8, tp=8, sequence_parallel=True, zero=2, recompute="full"),
        _plan(dp=16, tp=4, zero=0, gbs=512),
        _plan(dp=4, tp=4, pp=4, zero=3, pp_schedule="gpipe", stages=((0, 7), (7, 16), (16, 25), (25, 32))),
        _plan(dp=4, tp=4, pp=4, zero=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2),
        _plan(dp=8, tp=4, cp=2, cp_kind="allgather", sequence_parallel=True, zero=3, ep=4),
        _plan(dp=64, zero=3, offload=Offload(optimizer=True, params=True, grads=True), dtype="fp32"),
    ],
    "deepspeed": [
        _plan(dp=64, zero=3, recompute="full"),
        _plan(dp=16, tp=4, zero=1),
        _plan(dp=64, zero=2, offload=Offload(optimizer=True), dtype="fp16"),
        _plan(dp=64, zero=3, offload=Offload(optimizer=True, params=True, grads=True), dtype="fp32"),
        _plan(dp=32, tp=2, zero=0, gbs=512, mbs=4),
    ],
    "accelerate": [
        _plan(dp=64, zero=3, recompute="full"),
        _plan(dp=64, zero=2),
        _plan(dp=16, tp=4, zero=3),
        _plan(dp=32, cp=2, cp_kind="allgather", zero=2, recompute="full"),
        _plan(dp=64, zero=0, recompute="full", dtype="fp16"),
        _plan(dp=64, zero=3, offload=Offload(optimizer=True, params=True, grads=True), dtype="fp32"),
    ],
}


def _read_back(plan: Plan, engine: str, tmp_path: Path) -> Plan:
    path = tmp_path / f"exported.{engine}"
    path.write_text(export_config(plan, engine, plan_name="p.yaml"))
    cfg = read_config(engine, path)
    # the model file gives the sequence where the format has none (DeepSpeed's JSON)
    return to_plan(cfg, model_file="model.py", num_blocks=plan.model.num_blocks, sha256="0" * 64,
                   cluster_ref=cfg.cluster or "h100-80g", gpus_per_node=cfg.gpus_per_node or 8,
                   default_seq_len=plan.training.seq_len)


def _layout(plan: Plan) -> tuple:
    """What runs: the degrees and settings, with the stage split as block ranges (None and an even
    split written out are the same split)."""
    return (dataclasses.replace(plan.parallel, stages=None), plan.stage_ranges(), plan.block_recompute(),
            plan.training, plan.cluster)


@pytest.mark.parametrize(("engine", "index"), [(e, i) for e, plans in ROUND_TRIPS.items() for i in range(len(plans))])
def test_export_then_read_gives_back_the_plan(engine: str, index: int, tmp_path: Path) -> None:
    plan = ROUND_TRIPS[engine][index]
    assert plan_reason(get_engine(engine), plan) is None
    back = _read_back(plan, engine, tmp_path)
    assert _layout(back) == _layout(plan)


@pytest.mark.parametrize(("engine", "plan", "feature"), [
    ("torchtitan", _plan(dp=64, zero=1), "ZeRO stage 1"),
    ("torchtitan", _plan(dp=64, zero=3, recompute="selective"), "recompute selective"),
    ("torchtitan", _plan(dp=8, tp=8, cp=1, zero=3, dtype="fp16"), "dtype fp16"),
    ("megatron", _plan(dp=64, zero=3, recompute="op"), "recompute op"),
    ("megatron", _plan(dp=4, tp=4, pp=4, zero=1, pp_schedule="gpipe"), "gpipe"),
    ("megatron", _plan(dp=4, tp=4, pp=4, zero=3), "Megatron-FSDP"),
    ("megatron", _plan(dp=4, tp=4, pp=4, zero=1, recompute_blocks=((5, 3, 0),) * 4), "per-stage recompute"),
    ("megatron", _plan(dp=64, zero=3, offload=Offload(activations=True)), "offload activations"),
    ("deepspeed", _plan(dp=16, pp=4, zero=1), "pipeline parallelism"),
    ("deepspeed", _plan(dp=32, cp=2, zero=1), "context parallelism"),
    ("deepspeed", _plan(dp=8, tp=8, sequence_parallel=True, zero=1), "with sequence parallelism"),
    ("accelerate", _plan(dp=16, tp=4, zero=0), "without FSDP2"),
    ("accelerate", _plan(dp=64, ep=4, zero=3), "expert parallelism"),
])
def test_what_an_engine_cannot_express_is_refused_by_name(engine: str, plan: Plan, feature: str) -> None:
    with pytest.raises(AutoparError) as err:
        export_config(plan, engine, plan_name="p.yaml")
    assert feature in str(err.value)
    assert f"autopar plan MODEL.py --gpus N --engine {engine}" in str(err.value)


def test_every_search_knob_of_an_engine_is_a_feature_it_exports() -> None:
    """What plan --engine offers is what export accepts: each knob value of each engine has a plan
    that exports (and the autopar engine is every feature)."""
    assert search_knobs(ENGINES["autopar"], {}, None) == {}
    for name in EXPORT_ENGINES:
        knobs = search_knobs(ENGINES[name], {}, None)
        assert set(knobs["zero_stages"]) == set(ENGINES[name].zero_stages)
        for zero in knobs["zero_stages"]:
            if name == "accelerate" or zero:
                assert plan_reason(ENGINES[name], _plan(dp=64, zero=zero)) is None, (name, zero)
        for mode in knobs["recompute_modes"]:
            assert plan_reason(ENGINES[name], _plan(dp=64, zero=max(knobs["zero_stages"]), recompute=mode)) is None


def test_a_constraint_the_engine_cannot_run_is_one_line() -> None:
    with pytest.raises(AutoparError, match="DeepSpeed cannot run --pp 4"):
        search_knobs(ENGINES["deepspeed"], {"pp": (4,)}, None)
    with pytest.raises(AutoparError, match="torchtitan cannot run --zero 1"):
        search_knobs(ENGINES["torchtitan"], {"zero": (1, 3)}, None)
    with pytest.raises(AutoparError, match="torchtitan does not train in fp16"):
        search_knobs(ENGINES["torchtitan"], {}, "fp16")


# --- read: what a user's file says ------------------------------------------------------------------------------

def test_megatron_reads_a_launch_line_with_its_gpu_count_and_lists_what_it_does_not_read(tmp_path: Path) -> None:
    f = tmp_path / "run.sh"
    f.write_text("torchrun --nproc_per_node=8 --nnodes 4 pretrain_gpt.py \\\n  --num-layers 32 --lr 3e-4 "
                 "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 14 "
                 "--micro-batch-size 1 --global-batch-size 64 --seq-length 4096 --bf16 --recompute-granularity full "
                 "--recompute-method block --recompute-num-layers 4  # a comment\n")
    cfg = read_config("megatron", f)
    assert (cfg.num_gpus, cfg.tp, cfg.pp, cfg.chunk_layers, cfg.recompute_full_per_chunk) == (32, 2, 2, (14, 18), 4)
    assert cfg.ignored == ("--lr",)
    plan = to_plan(cfg, model_file="m.py", num_blocks=32, sha256=None, cluster_ref="h100-80g", gpus_per_node=8,
                   default_seq_len=None)
    assert plan.parallel.dp == 8 and plan.parallel.recompute_blocks == ((10, 0, 4), (14, 0, 4))


@pytest.mark.parametrize(("text", "needle"), [
    ("--tensor-model-parallel-size 8 --tensor-paralel 2", "--tensor-paralel is not a Megatron-LM flag"),
    ("--recompute-granularity coarse", "invalid choice: 'coarse'"),
    ("--micro-batch-size two", "invalid int value"),
    ("--cp-comm-type a2a+p2p --context-parallel-size 4", "a2a+p2p is not modelled"),
    ("--recompute-granularity selective --recompute-modules mlp", "selective recompute of mlp"),
    ("--pipeline-model-parallel-size 4 --num-layers 30", "do not divide into pp 4"),
])
def test_megatron_flags_megatron_would_refuse_are_one_line(text: str, needle: str, tmp_path: Path) -> None:
    f = tmp_path / "flags.txt"
    f.write_text(text)
    with pytest.raises(AutoparError) as err:
        read_config("megatron", f)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_contradictions_with_the_world_and_the_model_are_one_line(tmp_path: Path) -> None:
    f = tmp_path / "flags.txt"
    f.write_text("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 3 --num-layers 30 "
                 "--global-batch-size 64 --micro-batch-size 1 --seq-length 2048")
    cfg = read_config("megatron", f)
    with pytest.raises(AutoparError, match="does not divide 64 GPUs"):
        to_plan(cfg.with_overrides(num_gpus=64), model_file="m.py", num_blocks=30, sha256=None, cluster_ref="x",
                gpus_per_node=8, default_seq_len=None)
    with pytest.raises(AutoparError, match="configures 30 layers but m.py has 32"):
        to_plan(cfg.with_overrides(num_gpus=48), model_file="m.py", num_blocks=32, sha256=None, cluster_ref="x",
                gpus_per_node=8, default_seq_len=None)
    with pytest.raises(AutoparError, match="global batch 64 is not divisible by micro-batch 1 x dp 3"):
        to_plan(cfg.with_overrides(num_gpus=72, global_batch_size=64), model_file="m.py", num_blocks=30, sha256=None,
                cluster_ref="x", gpus_per_node=8, default_seq_len=None)
    with pytest.raises(AutoparError, match="does not say how many GPUs"):
        to_plan(cfg, model_file="m.py", num_blocks=30, sha256=None, cluster_ref="x", gpus_per_node=8,
                default_seq_len=None)


def test_torchtitan_default_split_follows_torchtitans_rule(tmp_path: Path) -> None:
    """Without module names torchtitan shares layers + 1 + 1 over the stages, the first and last
    stage giving one layer each to the embedding and the head (distributed/pipeline_parallel.py)."""
    f = tmp_path / "tt.toml"
    f.write_text("[parallelism]\npipeline_parallel_degree = 4\ndata_parallel_shard_degree = 2\n"
                 "[training]\nlocal_batch_size = 8\nseq_len = 2048\n")
    cfg = read_config("torchtitan", f)
    plan = to_plan(cfg, model_file="m.py", num_blocks=32, sha256=None, cluster_ref="x", gpus_per_node=8,
                   default_seq_len=None)
    assert [e - s for s, e in plan.stage_ranges()] == [8, 9, 8, 7]
    assert plan.training.global_batch_size == 16 and plan.parallel.zero == 2  # FSDP with pp: reshard never


def test_a_file_of_the_wrong_engine_is_one_line(tmp_path: Path) -> None:
    args = tmp_path / "flags.sh"
    args.write_text("--tensor-model-parallel-size 8\n")
    with pytest.raises(AutoparError, match="unknown engine 'jax'"):
        read_config("jax", args)
    with pytest.raises(AutoparError, match="not a DeepSpeed config JSON"):
        read_config("deepspeed", args)
    with pytest.raises(AutoparError, match="not an accelerate config"):
        read_config("accelerate", args)
    with pytest.raises(AutoparError, match="cannot read '--tensor-model-parallel-size'"):
        read_config("torchtitan", args)


# --- the engines' own parsers accept the exports ---------------------------------------------------------------------

@pytest.mark.parametrize("engine", EXPORT_ENGINES)
def test_the_engines_own_code_accepts_every_export(engine: str) -> None:
    from autopar.engines.check import PACKAGES, check_export

    pytest.importorskip({"megatron": "megatron.core"}.get(engine, PACKAGES[engine]))
    for plan in ROUND_TRIPS[engine]:
        text = export_config(plan, engine, plan_name="p")
        assert check_export(plan, engine, text).startswith(f"checked with {PACKAGES[engine]}")


def test_an_engine_that_reads_other_degrees_is_caught() -> None:
    """The check compares what the engine reads with the plan: a DeepSpeed JSON edited to another
    batch is refused by DeepSpeed itself, one with another ZeRO stage by the comparison."""
    pytest.importorskip("deepspeed")
    from autopar.engines.check import check_export

    plan = ROUND_TRIPS["deepspeed"][0]
    edited = json.loads(export_config(plan, "deepspeed", plan_name="p"))
    with pytest.raises(AutoparError, match="deepspeed .* refuses the export"):
        check_export(plan, "deepspeed", json.dumps({**edited, "train_batch_size": 500}))
    with pytest.raises(AutoparError, match="the engine reads the ZeRO stage 2, the plan has 3"):
        check_export(plan, "deepspeed", json.dumps({**edited, "zero_optimization": {"stage": 2}}))


def test_torchtitan_reads_the_recompute_policy_autopar_wrote() -> None:
    pytest.importorskip("torchtitan")
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, FullAC, SelectiveAC

    from autopar.engines.torchtitan import config_of, overrides

    sections = dataclasses.make_dataclass("Sections", [
        ("activation_checkpoint", ActivationCheckpointingConfig, dataclasses.field(default_factory=SelectiveAC.Config))])
    ConfigManager.register_tyro_rules(custom_registry)
    for mode, kind in (("full", FullAC.Config), ("op", SelectiveAC.Config), ("none", type(None))):
        args = [a for a in overrides(config_of(_plan(dp=64, zero=3, recompute=mode))) if a.startswith("activation")]
        assert isinstance(tyro.cli(sections, args=args, registry=custom_registry).activation_checkpoint, kind)


# --- the published Megatron runs, as a user writes their flags --------------------------------------------------------

CALIBRATION_FILES = {"gpt3-175b-128": "gpt3-175b-128.sh", "nemotron4-15b-16-tp2": "nemotron4-15b-16-tp2.sh",
                     "nemotron4-15b-16-tp4": "nemotron4-15b-16-tp4.sh", "nemotron4-340b-128": "nemotron4-340b-128.sh"}


def test_megatron_flags_of_the_published_runs_reproduce_the_calibration() -> None:
    """``estimate --from megatron`` on each Megatron-Core row of h100_public.yaml, context parallel
    ones included (its flags in
    tests/data/engines/megatron) prices what benchmarks/calibration.py prices for that row. Memory
    too, but for Nemotron-4 340B: NeMo's bf16 optimizer keeps no fp32 master copy, which no
    Megatron-LM flag says (the flags' precision-aware optimizer keeps one: more memory)."""
    from autopar.reference_h100 import model_path, public_plan, public_runs, software_cluster

    runs = [r for r in public_runs() if r.software == "megatron"]
    assert len(runs) == 17
    for run in runs:
        cluster, profile = software_cluster(run)
        default = f"{run.name}.sh" if run.group == "dgxc_llama31" else f"mcore-{run.name}.sh"
        flags = MEGATRON_RUNS / CALIBRATION_FILES.get(run.name, default)
        got = api.estimation_from("megatron", flags, str(model_path(run.model)), profile).estimation.estimate
        want = api.estimation(str(model_path(run.model)), public_plan(run, profile), cluster).estimate
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-3), run.name
        if run.name != "nemotron4-340b-128":
            assert got.peak_memory_bytes == pytest.approx(want.peak_memory_bytes, rel=1e-3), run.name
        else:
            assert got.peak_memory_bytes > want.peak_memory_bytes


def test_plan_for_an_engine_offers_only_what_it_runs() -> None:
    model = REPO / "tests" / "data" / "models" / "gpt12.py"
    for name in ("deepspeed", "torchtitan"):
        found = api.plan_search(model, 8, "a100-80g", top=5, engine=name, global_batch=16)
        assert found.plans and all(plan_reason(ENGINES[name], p) is None for p in found.plans)
        if name == "deepspeed":
            assert all(p.parallel.pp == 1 and p.parallel.cp == 1 for p in found.plans)
