"""Published reference runs as plans: Megatron SC21 Table 1, Korthikanti 2022 Tables 4 and 5, ZeRO SC20.

Used by the calibration benchmark and the tests. The data files are read from ``../shared/calibration``
when present (the project's shared copy) and otherwise from the copy shipped in ``calibration/``.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from autopar.graph import ModelGraph, build_graph
from autopar.models.gpt import GPTConfig, model_file

REPO = Path(__file__).resolve().parent.parent
# The repository's calibration/ first: it is the published figures of ../shared/calibration with
# what the project has added to them since (each addition names its source); the shared copy only
# where the repository has no such file.
_CAL_DIRS = (REPO / "calibration", REPO.parent / "shared" / "calibration")


def calibration_file(name: str) -> Path:
    for d in _CAL_DIRS:
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"calibration file {name} not found in {', '.join(map(str, _CAL_DIRS))}")


def load_calibration(name: str) -> dict:
    return yaml.safe_load(calibration_file(name).read_text(encoding="utf-8"))


def written_model_path(source: str, stem: str) -> Path:
    """The model file ``source`` in a per-user temp directory, named ``stem`` and its content's
    digest (written once, atomically: a writer beside it renames its own temporary file)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / "autopar-models" / f"{stem}_{digest}.py"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{digest}.tmp")
        tmp.write_text(source, encoding="utf-8")
        tmp.replace(path)
    return path


def gpt_model_path(cfg: GPTConfig) -> Path:
    """A model file for ``cfg`` in a per-user temp directory (``written_model_path``)."""
    return written_model_path(model_file(cfg), "gpt")


def gpt_graph(cfg: GPTConfig, dtype: str = "bf16") -> ModelGraph:
    return build_graph(str(gpt_model_path(cfg)), dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class MegatronRow:
    """One row of Megatron SC21 Table 1 (full recompute, no SP, ZeRO-0, fp16)."""

    params_billion: float
    num_heads: int
    hidden_size: int
    num_layers: int
    tp: int
    pp: int
    num_gpus: int
    global_batch: int
    tflops_per_gpu: float
    dp: int
    micro_batch: int
    layers_per_virtual_stage: int | None
    iteration_time_s: float

    @property
    def virtual_stages(self) -> int:
        if not self.layers_per_virtual_stage:
            return 1
        return (self.num_layers // self.pp) // self.layers_per_virtual_stage

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
                         seq_len=2048, vocab_size=51200)


def megatron_rows() -> list[MegatronRow]:
    data = load_calibration("megatron_sc21_table1.yaml")
    cols = data["columns"]
    rename = {"heads": "num_heads", "hidden": "hidden_size", "layers": "num_layers", "gpus": "num_gpus"}
    return [MegatronRow(**{rename.get(c, c): v for c, v in zip(cols, row)}) for row in data["rows"]]


def sc21_cluster():  # noqa: ANN201 - returns autopar.cluster.Cluster
    """a100-80g-megatron with the software SC21's runs used: Megatron-LM of early 2021, whose tensor-parallel
    backward all-reduce was synchronous. A setting of the run, as torchtitan's FSDP2 settings are
    (autopar.reference_a100.a100_cluster), never a fitted term.

    Megatron-LM overlapped a column-parallel layer's input-gradient all-reduce with its weight-gradient
    GEMM only from 2021-08-30 (commit cf7efd4f, "allreduce overlap with wgrad gemm",
    ``--async-tensor-parallel-allreduce``; the default from 2022-02-13, commit 83b1e42f). SC21's
    results (arXiv:2104.04473, April 2021) predate it: their mpu/layers.py wrapped each column-parallel
    input in ``copy_to_tensor_model_parallel_region``, whose backward all-reduces after the layer's
    whole backward, in the path of the next op. The a100-80g-megatron profile prices the later Megatron-LM of
    Korthikanti et al. 2022 (Tables 4 and 5), which overlaps it."""
    import dataclasses

    from autopar.cluster import load_cluster

    return dataclasses.replace(load_cluster("a100-80g-megatron"), async_tp_backward=False)


def megatron_plan(row: MegatronRow):  # noqa: ANN201 - returns autopar.plan.Plan
    """The published configuration of ``row`` as a plan v1."""
    from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

    v = row.virtual_stages
    return Plan(
        model=ModelRef(file=str(gpt_model_path(row.config)), num_blocks=row.num_layers),
        cluster=ClusterRef(profile="a100-80g-megatron", num_gpus=row.num_gpus, gpus_per_node=8),
        training=Training(global_batch_size=row.global_batch, micro_batch_size=row.micro_batch, seq_len=2048,
                          dtype="fp16", optimizer="adam"),
        parallel=Parallel(dp=row.dp, tp=row.tp, pp=row.pp, recompute="full",
                          pp_schedule="interleaved-1f1b" if v > 1 else "1f1b", pp_virtual_stages=v),
    )


KORTHIKANTI_22B = GPTConfig(num_layers=48, hidden_size=6144, num_heads=64, seq_len=2048, vocab_size=51200)
TABLE4_MODES = {  # experiment -> (sequence_parallel, recompute)
    "baseline_no_recompute": (False, "none"),
    "sequence_parallel": (True, "none"),
    "full_recompute": (False, "full"),
    "selective_recompute": (False, "selective"),
    "selective_and_sequence": (True, "selective"),
}


# Korthikanti et al. 2022 Table 5: each model's two published settings -> (sequence_parallel, recompute)
TABLE5_MODES = {"full_recompute": (False, "full"), "present_work": (True, "selective")}
PLAIN_GPT = REPO / "autopar" / "models" / "plain_gpt.py"


@dataclass(frozen=True, kw_only=True)
class Table5Row:
    """One model of Korthikanti et al. 2022 Table 3 / Table 5 (data parallel 1, GPUs = tp x pp)."""

    model: str
    num_heads: int
    hidden_size: int
    num_layers: int
    tp: int
    pp: int
    num_gpus: int
    global_batch: int
    micro_batch: int
    full_recompute_s: float
    present_work_s: float
    mfu_present_pct: float
    hfu_present_pct: float
    throughput_increase_pct: float

    def time_s(self, mode: str) -> float:
        return self.full_recompute_s if mode == "full_recompute" else self.present_work_s


def table5_rows() -> list[Table5Row]:
    data = load_calibration("korthikanti_2022.yaml")["table5_end_to_end"]
    rename = {"heads": "num_heads", "hidden": "hidden_size", "layers": "num_layers", "gpus": "num_gpus"}
    return [Table5Row(**{rename.get(c, c): v for c, v in zip(data["columns"], row)}) for row in data["rows"]]


def plain_gpt_path(size: str) -> Path:
    """autopar/models/plain_gpt.py -- a model file that declares no tp_plan -- with ``SIZE = size``, in a
    per-user temp directory (``written_model_path``)."""
    text = PLAIN_GPT.read_text(encoding="utf-8")
    if 'SIZE = "tiny"' not in text:
        raise ValueError(f"{PLAIN_GPT} has no SIZE = \"tiny\" line to set")
    return written_model_path(text.replace('SIZE = "tiny"', f"SIZE = {size!r}".replace("'", '"'), 1), "plain_gpt")


def table5_graph(row: Table5Row) -> ModelGraph:
    """The 16-bit graph of ``row``'s model from the plain model file (its tp plan inferred); the
    file's size table must hold the row's shape."""
    import runpy

    sizes = runpy.run_path(str(PLAIN_GPT))["SIZES"]
    want = dict(layers=row.num_layers, hidden=row.hidden_size, heads=row.num_heads, vocab=51200, seq=2048)
    if sizes.get(row.model) != want:
        raise ValueError(f"plain_gpt.py SIZES[{row.model!r}] = {sizes.get(row.model)}, Table 3 says {want}")
    return build_graph(str(plain_gpt_path(row.model)), dtype="fp16")


def table5_plan(row: Table5Row, mode: str):  # noqa: ANN201 - returns autopar.plan.Plan
    """The published configuration of ``row`` in ``mode`` (TABLE5_MODES) as a plan v1 on a100-80g-megatron:
    dp 1, tp and pp as published, plain 1F1B, micro-batch as published, fp16, ZeRO-0."""
    from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

    sp, recompute = TABLE5_MODES[mode]
    return Plan(
        model=ModelRef(file=str(plain_gpt_path(row.model)), num_blocks=row.num_layers),
        cluster=ClusterRef(profile="a100-80g-megatron", num_gpus=row.num_gpus, gpus_per_node=8),
        training=Training(global_batch_size=row.global_batch, micro_batch_size=row.micro_batch, seq_len=2048,
                          dtype="fp16", optimizer="adam"),
        parallel=Parallel(dp=1, tp=row.tp, pp=row.pp, sequence_parallel=sp, recompute=recompute,
                          pp_schedule="1f1b", pp_virtual_stages=1),
    )
