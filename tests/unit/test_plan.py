"""Plan file v1 (docs/design.md §3, a contract): strict load/save, stage ranges, and one-line errors naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.plan import (
    ClusterRef,
    ModelRef,
    Parallel,
    Plan,
    Training,
    dump_plan,
    even_stage_ranges,
    load_plan,
    parse_plan,
    plan_from_dict,
    save_plan,
)

BASE = {
    "version": 1,
    "model": {"file": "examples/gpt.py", "num_blocks": 16},
    "cluster": {"profile": "a100-80g", "num_gpus": 32, "gpus_per_node": 8},
    "training": {"global_batch_size": 64, "micro_batch_size": 2, "seq_len": 2048, "dtype": "bf16",
                 "optimizer": "adam"},
    "parallel": {"dp": 2, "tp": 4, "pp": 4, "cp": 1, "cp_kind": "ring", "sequence_parallel": True, "zero": 1,
                 "recompute": "selective", "pp_schedule": "1f1b", "pp_virtual_stages": 1},
}


def _text(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def _with(**changes: object) -> str:
    """BASE with dotted-key changes applied (value None deletes the key)."""
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for p in parents:
            node = node[p]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return _text(data)


# ---------------------------------------------------------------- round trip


def test_base_plan_loads_with_its_values() -> None:
    plan = parse_plan(_text(BASE))
    assert plan.parallel.tp == 4 and plan.parallel.pp == 4 and plan.parallel.dp == 2
    assert plan.parallel.sequence_parallel is True and plan.parallel.recompute == "selective"
    assert plan.training.dtype_bytes == 2
    assert plan.num_microbatches == 64 // (2 * 2)
    assert plan.cluster.num_nodes == 4


@pytest.mark.parametrize("extra", [
    {},
    {"parallel__stages": [[0, 3], [3, 8], [8, 13], [13, 16]]},
    {"parallel__pp_schedule": "interleaved-1f1b", "parallel__pp_virtual_stages": 2},
    {"parallel__pp_schedule": "interleaved-1f1b", "parallel__pp_virtual_stages": 2,
     "parallel__stages": [[0, 1], [1, 3], [3, 5], [5, 7], [7, 9], [9, 11], [11, 13], [13, 16]]},
    {"model__sha256": "ab" * 32, "parallel__cp": 2, "parallel__dp": 1, "parallel__cp_kind": "ulysses",
     "parallel__zero": 3, "parallel__recompute": "full", "training__dtype": "fp16", "training__optimizer": "sgd"},
])
def test_save_load_round_trip(tmp_path: Path, extra: dict) -> None:
    plan = parse_plan(_with(**extra))
    path = save_plan(plan, tmp_path / "sub" / "plan.yaml")
    again = load_plan(path)
    assert again == plan
    assert again.stage_ranges() == plan.stage_ranges()
    assert dump_plan(again) == dump_plan(plan)  # saving is deterministic
    assert not list(path.parent.glob("*.tmp")), "atomic save left a temp file behind"


def test_prediction_is_written_but_ignored_on_load(tmp_path: Path) -> None:
    plan = parse_plan(_text(BASE)).with_prediction({"step_time_s": 1.5, "peak_memory_bytes": 7e10, "stages": (1, 2)})
    path = save_plan(plan, tmp_path / "p.yaml")
    raw = yaml.safe_load(path.read_text())
    assert raw["prediction"]["step_time_s"] == 1.5 and raw["prediction"]["stages"] == [1, 2]
    loaded = load_plan(path)
    assert loaded.prediction is None
    assert loaded == plan
    # A stale or hand-edited prediction never breaks loading.
    raw["prediction"] = {"anything": ["goes", 1]}
    assert parse_plan(_text(raw)) == plan


def test_optional_keys_default() -> None:
    data = copy.deepcopy(BASE)
    data["parallel"] = {"dp": 2, "tp": 4, "pp": 4}
    data["training"] = {"global_batch_size": 64, "micro_batch_size": 2, "seq_len": 2048}
    plan = plan_from_dict(data)
    p = plan.parallel
    assert (p.cp, p.cp_kind, p.sequence_parallel, p.zero, p.recompute, p.pp_schedule, p.pp_virtual_stages, p.stages) == (
        1, "ring", False, 0, "none", "1f1b", 1, None)
    assert (plan.training.dtype, plan.training.optimizer) == ("bf16", "adam")
    assert "stages" not in yaml.safe_load(dump_plan(plan))["parallel"]


def test_shipped_example_plan_loads_and_round_trips(repo: Path, tmp_path: Path) -> None:
    plan = load_plan(repo / "plans" / "gpt3-175b-megatron-64gpu.yaml")
    assert plan.parallel.world_size == plan.cluster.num_gpus == 64
    assert plan.parallel.num_stage_chunks == 8 * 3
    assert plan.stage_ranges() == tuple((4 * i, 4 * i + 4) for i in range(24))
    assert load_plan(save_plan(plan, tmp_path / "p.yaml")) == plan


# ---------------------------------------------------------------- stage ranges


def test_explicit_stages_are_used_and_even_split_otherwise() -> None:
    uneven = parse_plan(_with(parallel__stages=[[0, 3], [3, 8], [8, 13], [13, 16]]))
    assert uneven.stage_ranges() == ((0, 3), (3, 8), (8, 13), (13, 16))
    assert parse_plan(_text(BASE)).stage_ranges() == ((0, 4), (4, 8), (8, 12), (12, 16))
    inter = parse_plan(_with(parallel__pp_schedule="interleaved-1f1b", parallel__pp_virtual_stages=2))
    assert len(inter.stage_ranges()) == 8 and inter.stage_ranges()[-1] == (14, 16)


def test_even_split_puts_extra_blocks_in_the_middle() -> None:
    # The first chunk also holds the embedding and the last the head: they get the smaller share.
    assert even_stage_ranges(10, 4) == ((0, 2), (2, 5), (5, 8), (8, 10))
    assert even_stage_ranges(9, 4) in (((0, 2), (2, 5), (5, 7), (7, 9)), ((0, 2), (2, 4), (4, 7), (7, 9)))
    assert even_stage_ranges(96, 8) == tuple((12 * i, 12 * i + 12) for i in range(8))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 400), st.data())
def test_even_stage_ranges_properties(num_blocks: int, data: st.DataObject) -> None:
    chunks = data.draw(st.integers(1, num_blocks))
    ranges = even_stage_ranges(num_blocks, chunks)
    assert len(ranges) == chunks
    assert ranges[0][0] == 0 and ranges[-1][1] == num_blocks
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "ranges must be contiguous"
    sizes = [e - s for s, e in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    base, extra = divmod(num_blocks, chunks)
    if chunks >= 3 and extra <= chunks - 2:
        assert sizes[0] == sizes[-1] == base, "edge chunks get extra blocks only when the middle is full"
    # Every even split is accepted as explicit stages by a plan.
    Parallel(dp=1, tp=1, pp=chunks, stages=[list(r) for r in ranges])


def test_more_chunks_than_blocks_is_an_error() -> None:
    with pytest.raises(PlanError, match="pp"):
        even_stage_ranges(4, 5)


# ---------------------------------------------------------------- bad plans

PY_TAG = "!!python/object/apply:os.system ['touch {marker}']\n"

BAD_PLANS = [
    # (id, text, substring the one-line message must contain: the offending key)
    ("malformed-yaml", "version: 1\nmodel: {file: x.py, num_blocks: 2\ncluster: [\n", "not valid YAML at line"),
    ("tab-indent-yaml", "version: 1\nmodel:\n\tfile: x.py\n", "not valid YAML"),
    ("empty-file", "", "mapping"),
    ("top-level-list", "- version: 1\n", "mapping"),
    ("unknown-top-key", _with(hints="fast please"), "'hints'"),
    ("unknown-nested-key", _with(parallel__ep=2), "'parallel.ep'"),
    ("unknown-nested-key-training", _with(training__lr=1e-4), "'training.lr'"),
    ("missing-top-key", _with(cluster=None), "'cluster'"),
    ("missing-nested-key", _with(training__seq_len=None), "'training.seq_len'"),
    ("missing-parallel-degree", _with(parallel__tp=None), "'parallel.tp'"),
    ("section-not-mapping", _with(parallel=8), "parallel"),
    ("string-for-tp", _with(parallel__tp="4"), "parallel.tp"),
    ("bool-for-pp", _with(parallel__pp=True), "parallel.pp"),
    ("float-for-num-blocks", _with(model__num_blocks=16.0), "model.num_blocks"),
    ("zero-dp", _with(parallel__dp=0), "parallel.dp"),
    ("negative-tp", _with(parallel__tp=-4), "parallel.tp"),
    ("zero-micro-batch", _with(training__micro_batch_size=0), "training.micro_batch_size"),
    ("degrees-do-not-multiply", _with(cluster__num_gpus=64), "cluster.num_gpus"),
    ("global-batch-not-divisible", _with(training__global_batch_size=66), "training.global_batch_size"),
    ("interleaved-without-virtual-stages", _with(parallel__pp_schedule="interleaved-1f1b"), "parallel.pp_schedule"),
    ("virtual-stages-without-interleaving", _with(parallel__pp_virtual_stages=2), "parallel.pp_virtual_stages"),
    ("interleaved-microbatches-not-multiple-of-pp",
     _with(parallel__pp_schedule="interleaved-1f1b", parallel__pp_virtual_stages=2, training__global_batch_size=24),
     "pp"),
    ("fewer-microbatches-than-pp", _with(training__global_batch_size=12), "micro_batch_size"),
    ("more-chunks-than-blocks", _with(model__num_blocks=3), "pp_virtual_stages"),
    ("stages-not-contiguous", _with(parallel__stages=[[0, 4], [5, 8], [8, 12], [12, 16]]), "parallel.stages[1]"),
    ("stages-wrong-count", _with(parallel__stages=[[0, 8], [8, 16]]), "parallel.stages"),
    ("stages-not-ending-at-num-blocks", _with(parallel__stages=[[0, 4], [4, 8], [8, 12], [12, 15]]),
     "parallel.stages"),
    ("stages-not-starting-at-zero", _with(parallel__stages=[[1, 4], [4, 8], [8, 12], [12, 16]]), "parallel.stages"),
    ("stages-empty-range", _with(parallel__stages=[[0, 4], [4, 4], [4, 12], [12, 16]]), "parallel.stages[1]"),
    ("stages-not-pairs", _with(parallel__stages=[[0, 4, 8], [8, 12], [12, 14], [14, 16]]), "parallel.stages[0]"),
    ("stages-not-a-list", _with(parallel__stages="even"), "parallel.stages"),
    ("tp-exceeds-node", _with(cluster__num_gpus=32, cluster__gpus_per_node=2), "parallel.tp"),
    ("seq-not-divisible-by-cp", _with(parallel__cp=2, parallel__dp=1, training__seq_len=2047), "training.seq_len"),
    ("unknown-recompute", _with(parallel__recompute="partial"), "parallel.recompute"),
    ("unknown-cp-kind", _with(parallel__cp_kind="tree"), "parallel.cp_kind"),
    ("unknown-schedule", _with(parallel__pp_schedule="zb-v"), "parallel.pp_schedule"),
    ("zero-stage-4", _with(parallel__zero=4), "parallel.zero"),
    ("sp-not-bool", _with(parallel__sequence_parallel="yes"), "parallel.sequence_parallel"),
    ("unknown-dtype", _with(training__dtype="int8"), "training.dtype"),
    ("unknown-optimizer", _with(training__optimizer="lion"), "training.optimizer"),
    ("bad-sha256", _with(model__sha256="1234"), "model.sha256"),
    ("empty-model-file", _with(model__file=""), "model.file"),
    ("version-2", _with(version=2), "version"),
    ("version-missing", _with(version=None), "'version'"),
    ("python-object-tag", PY_TAG, "python/object"),
    ("python-tag-inside-plan", _with().replace("profile: a100-80g", "profile: !!python/name:os.getcwd ''"),
     "python/name"),
]


@pytest.mark.parametrize("text,key", [pytest.param(t, k, id=i) for i, t, k in BAD_PLANS])
def test_bad_plan_is_one_line_error_naming_the_key(text: str, key: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = text.replace("{marker}", str(marker))
    with pytest.raises(PlanError) as info:
        parse_plan(text, source="plan.yaml")
    msg = str(info.value)
    assert "\n" not in msg, f"multi-line error: {msg!r}"
    assert key in msg, f"error does not name {key!r}: {msg}"
    assert msg.startswith("plan.yaml"), f"error does not name the file: {msg}"
    assert not marker.exists(), "a YAML tag executed code"


def test_at_least_twelve_kinds_of_bad_plan() -> None:
    assert len({i for i, _, _ in BAD_PLANS}) >= 12


def test_load_plan_missing_and_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "nope.yaml")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlanError) as info:
        load_plan(binary)
    assert "bin.yaml" in str(info.value) and "\n" not in str(info.value)


def test_load_plan_error_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "my-plan.yaml"
    path.write_text(_with(parallel__tp="eight"))
    with pytest.raises(PlanError, match=r"my-plan\.yaml.*parallel\.tp"):
        load_plan(path)


def test_dataclasses_validate_on_creation() -> None:
    """The frozen dataclasses check themselves, not only the YAML loader."""
    with pytest.raises(PlanError, match="parallel.tp"):
        Parallel(dp=1, tp=0, pp=1)
    with pytest.raises(PlanError, match="training.seq_len"):
        Training(global_batch_size=8, micro_batch_size=1, seq_len=True)
    with pytest.raises(PlanError, match="cluster.num_gpus"):
        Plan(model=ModelRef(file="m.py", num_blocks=4),
             cluster=ClusterRef(profile="a100-80g", num_gpus=8, gpus_per_node=8),
             training=Training(global_batch_size=8, micro_batch_size=1, seq_len=128),
             parallel=Parallel(dp=2, tp=2, pp=1))


@pytest.mark.parametrize("value", [True, 1.0])
def test_version_must_be_the_integer_1(value: object) -> None:
    with pytest.raises(PlanError, match="version"):
        parse_plan(_with(version=value))
