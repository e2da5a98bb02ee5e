"""torchtitan's FSDP2 runs on 64 A100 80GB (``torchtitan_a100.yaml``: pytorch/torchtitan
docs/performance.md), as plans priced on ``a100-80g``: a held-out source only, never fitted
(reference_fit.PREDICTED_ONLY).

Each row is a ``PublicRun`` of reference_h100 (the same Llama model file, plan and graph), group
``torchtitan_a100``, with the published tokens/s per GPU and MFU beside it (``TitanA100Row``).
The MFU is torchtitan's own (``torchtitan_mfu_pct``): the transcription is checked against it
(tests/unit/test_torchtitan_a100.py) and the calibration table prints the predicted run's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.cluster import Cluster, load_cluster
from autopar.reference import load_calibration
from autopar.reference_h100 import PublicRun, dict_rows

GROUP = "torchtitan_a100"
A100_PEAK_FLOPS = 312e12  # torchtitan utils.get_peak_flops for an A100: bf16 dense

# a100-80g prices autopar's own executor (FSDP2, eager PyTorch kernels), the software torchtitan's
# runs used, with the kernel terms fitted on SC21 and Korthikanti's Table 4 (reference_fit, priced
# under a100-80g-megatron's Megatron-LM software). Those terms (a GEMM efficiency curve, one attention
# efficiency, one HBM share for element-wise kernels) were never tied to Megatron's fused kernels the
# way h100-80g-megatron's ``fused_elementwise`` is: an eager model file's element-wise ops are priced
# as written, which is what a run with compile = false executes.
PROFILE = "a100-80g"


@dataclass(frozen=True, kw_only=True)
class TitanA100Row:
    """One row of the file: the run as priced, its table and activation checkpointing as the source
    names them, and the published tokens/s per GPU (torchtitan's WPS) and MFU (%)."""

    run: PublicRun
    table: str
    ac: str
    tokens_per_s_per_gpu: float
    mfu_pct: float


def a100_rows() -> list[TitanA100Row]:
    """Every row of torchtitan_a100.yaml, in file order."""
    data = load_calibration("torchtitan_a100.yaml")
    runs = dict_rows(GROUP, data)
    return [TitanA100Row(run=run, table=str(r["table"]), ac=str(r["ac"]),
                         tokens_per_s_per_gpu=float(r["published"]["tokens_per_s_per_gpu"]),
                         mfu_pct=float(r["published"]["mfu_pct"]))
            for run, r in zip(runs, data["rows"], strict=True)]


def a100_runs() -> list[PublicRun]:
    return [row.run for row in a100_rows()]


def a100_cluster(run: PublicRun) -> tuple[Cluster, str]:
    """(a100-80g with torchtitan's stated software settings, its name). Settings of the run, as its
    recompute or micro-batch are, never fitted terms -- a100-80g's own, stated again so that the
    source keeps them whatever the profile says: FSDP2's MixedPrecisionPolicy reduces gradients in
    fp32 (reduce_dtype=torch.float32), and FSDP2 reduce-scatters each block's gradients inside the
    backward pass.

    The share of a hidden collective's time that still costs (``overlap_cost_fraction``) is FSDP2's,
    h100-80g's figure: it is what NCCL's kernels take from the compute they hide behind (SMs and HBM,
    docs/profiles.md), a property of the software's kernels (a100-80g copies it; a100-80g-megatron's, the
    code's default 0.1, is Megatron's few-SM collectives). It is fitted on H100 (llm-foundry), never on these rows; the
    row it moves most is the one with the most hidden collective time (Llama 2 70B, per-op recompute:
    a third of its step), which was the worst (-9.9 %) at Megatron's figure."""
    if run.group != GROUP:
        raise ValueError(f"{run.name} is a {run.group} run, not {GROUP}")
    fsdp2 = load_cluster("h100-80g").overlap_cost_fraction
    cluster = dataclasses.replace(load_cluster(PROFILE), grad_reduce_bytes=4, overlap_grad_reduce=True,
                                  overlap_cost_fraction=fsdp2)
    return cluster, PROFILE


def torchtitan_params(run: PublicRun) -> int:
    """Parameters of torchtitan's Llama at this shape: untied embedding and output, per block the
    four attention projections (GQA: k and v at kv_heads), the SwiGLU's three matrices and two RMSNorm
    weights, and the final norm."""
    m = run.model
    h, head_dim = m.hidden_size, m.hidden_size // m.num_heads
    block = 2 * h * h + 2 * h * m.num_kv_heads * head_dim + 3 * h * m.ffn_hidden_size + 2 * h
    return m.num_layers * block + 2 * m.vocab_size * h + h


def torchtitan_flop_per_token(run: PublicRun) -> float:
    """torchtitan's num_flop_per_token as of the tables (April 2024, utils.get_num_flop_per_token over
    get_num_params(model)): 6 N + 12 L H Q T, N every parameter, the embedding included (excluded
    from 2024-04-26, after these tables), L layers, H heads, Q head dim, T seq."""
    m = run.model
    return 6.0 * torchtitan_params(run) + 12.0 * m.num_layers * m.hidden_size * run.seq_len


def torchtitan_mfu_pct(run: PublicRun, tokens_per_s_per_gpu: float) -> float:
    """MFU (%) as torchtitan's train.py logs it: 100 * num_flop_per_token * wps / peak."""
    return 100.0 * torchtitan_flop_per_token(run) * tokens_per_s_per_gpu / A100_PEAK_FLOPS


def tokens_per_s_per_gpu(run: PublicRun, step_time_s: float) -> float:
    """torchtitan's WPS of a step time: a rank's tokens (micro-batch x seq, no gradient accumulation)
    per second, tp 1."""
    return run.global_batch * run.seq_len / (step_time_s * run.num_gpus)
