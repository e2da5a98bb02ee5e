"""Megatron-Core mixture-of-experts runs on DGX H100 (``megatron_moe_h100.yaml``: NVIDIA's
Megatron-MoE-ModelZoo, Qwen3-235B-A22B and Mixtral 8x22B in BF16) as plans priced on
``h100-80g-megatron``: a held-out source only, never fitted -- no constant is chosen against it.

Each row becomes a ``MoeRow``: the published configuration as the source states it, the step time
(published, or derived from the published TFLOP/s with Megatron's own FLOP count,
``megatron_flops_per_step``), and the plan autopar can express closest to it (``row_plan``), with
every place the two differ named in ``MoePlan.flags``. A row autopar cannot price at all (a schedule
it does not model, a model without a model file here) gets ``MoePlan.skip`` and its reason.

The models are Hugging Face model files written as a user writes them (``autopar/models/hf_qwen3_moe.py``,
``hf_mixtral.py``: a config of the published values, no download), at the published size, measured on
meta once and kept in autopar's graph cache (``autopar.graph.cache``).

How Megatron-Core's settings map (``row_plan``):

- ZeRO: the distributed optimizer (FSDP "/") is ZeRO-1; Megatron-FSDP ("On") is priced as ZeRO-3.
- Sequence parallelism: on in every Megatron run at tp > 1, and in the plan: the MoE layers route
  each tp rank's sequence shard (Megatron-Core's MoE parallel folding, autopar.layout's ``folds_tp``).
- Expert parallelism: Megatron with expert tensor parallelism 1 draws its ep ranks from tp x dp
  (an ep group of 8 at tp 2 is the node's 8 GPUs); so does autopar under sequence parallelism, tp
  ranks first. An ep that does not divide dp x cp x tp or the experts becomes the largest one that
  does (flagged); expert tp > 1 is priced as 1 (flagged).
- Pipeline: Megatron's ``--account-for-embedding-in-pipeline-split`` / ``-loss-`` (Qwen3) count the
  embedding and the loss as one layer each; the plan's stages give each (virtual) chunk the layers
  Megatron's does. Where a chunk would hold no layer (Qwen3 at pp 32 x vpp 3: 96 units, one each),
  the plan keeps the per-rank layer counts with no interleaving (flagged).
- Recompute: none, full as stated; Megatron's ``--recompute-modules layernorm moe_act`` ("norm, act")
  reruns only the pre-MLP norm and the experts' activation: priced as none (flagged). No plan field
  carries those modules (``parallel.recompute`` is none, selective or full for the whole layer), so
  their memory saving is not priced: the pre-MLP norm's output and the SwiGLU's output, h + k f bytes
  per token of the sequence shard (autopar.cost.megatron_moe_memory takes them by keyword), 14 % of a
  Qwen3-235B layer's activations; the rerun, element-wise ops, is a few percent of a layer.
- Activations: as Megatron-Core keeps them (``activation_memory: megatron``): the attention half by
  the dense layer's formula, the MoE half from the block's widths -- the router's small fp32 outputs,
  k permuted rows of h, fc1's 2 f and the SwiGLU's f output per token (autopar.cost.megatron_moe_memory),
  not the HF file's eager saved tensors. The DeepEP rows are priced with the same rows: its dispatch
  keeps no more of them.
- Routing: priced balanced (moe_imbalance 1.0): the Qwen3 rows do not say (forced balance is the
  model zoo's benchmark practice), the Mixtral pair states dropless and forced balance.
- Element-wise work: as the profile's software runs it (``fused_elementwise``): both model configs
  set ``--moe-permute-fusion`` and ``--moe-router-fusion``, and Megatron-Core's grouped experts apply
  the routing weight inside a fused SwiGLU (autopar.cost.fused_moe), not as the HF file's eager ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.reference import load_calibration, written_model_path

GROUP = "megatron_moe_h100"
PROFILE = "h100-80g-megatron"
GPUS_PER_NODE = 8
MODELS_DIR = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True, kw_only=True)
class MoeModel:
    """A model of the rows: its model file and size, and the Megatron arguments its FLOP count reads."""

    key: str
    stem: str  # autopar/models/<stem>.py
    size: str  # its SIZES key
    layers: int
    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    experts: int
    moe_ffn: int
    topk: int
    vocab: int  # Megatron's padded vocabulary
    account_for_embedding_and_loss: bool  # --account-for-{embedding,loss}-in-pipeline-split


MODELS = {
    "qwen3-235b-a22b": MoeModel(key="qwen3-235b-a22b", stem="hf_qwen3_moe", size="235b-a22b", layers=94, hidden=4096,
                                heads=64, query_groups=4, kv_channels=128, experts=128, moe_ffn=1536, topk=8,
                                vocab=151936, account_for_embedding_and_loss=True),
    "mixtral-8x22b": MoeModel(key="mixtral-8x22b", stem="hf_mixtral", size="8x22b", layers=56, hidden=6144, heads=48,
                              query_groups=8, kv_channels=128, experts=8, moe_ffn=16384, topk=2, vocab=32000,
                              account_for_embedding_and_loss=False),
}


def megatron_flops_per_step(m: MoeModel, batch: int, seq: int) -> float:
    """Megatron-LM's model FLOPs of a step (training.py num_floating_point_operations, transformer_flops,
    as of the rows: every layer MoE, no shared expert, no MTP, SwiGLU, GQA, causal attention's score
    and context GEMMs halved): B s [12 L h (f_moe k 3/2) + 12 L h^2 (1 + g/a + s/(2h)) (a d / h) + 6 h V]."""
    q_ratio = m.kv_channels * m.heads / m.hidden
    mlp = 12 * m.layers * m.hidden * (m.moe_ffn * m.topk * 1.5)
    attn = 12 * m.layers * m.hidden * m.hidden * (1 + m.query_groups / m.heads + seq / m.hidden / 2) * q_ratio
    logit = 6 * m.hidden * m.vocab
    return batch * seq * (mlp + attn + logit)


@dataclass(frozen=True, kw_only=True)
class MoeRow:
    """One row of the file as the source states it, with its step time (published or derived)."""

    name: str
    source: str  # A | B (the file's header)
    section: str
    model_key: str
    dispatcher: str  # a2a | deepep
    gpus: int
    seq: int
    tp: int
    cp: int
    ep: int
    pp: int
    edp: int
    etp: int
    vpp: int
    dp: int
    fsdp: bool
    mbs: int
    gbs: int
    ga: int
    recompute: str  # as printed
    step_time_s: float
    tflops_per_gpu: float
    derived: str  # "" (published step time) or how it was derived
    notes: str
    code: str

    @property
    def model(self) -> MoeModel | None:
        return MODELS.get(self.model_key)


def moe_rows() -> list[MoeRow]:
    """Every row of megatron_moe_h100.yaml, in file order."""
    data = load_calibration("megatron_moe_h100.yaml")
    out = []
    for r in data["rows"]:
        pub = r["published"]
        tflops = float(pub["tflops_per_gpu"])
        if "step_time_s" in pub:
            step, derived = float(pub["step_time_s"]), ""
        else:
            m = MODELS[r["model"]]
            step = megatron_flops_per_step(m, r["gbs"], r["seq"]) / (tflops * 1e12 * r["gpus"])
            derived = "Megatron FLOPs / TFLOP/s"
        out.append(MoeRow(
            name=r["name"], source=r["source"], section=r["section"], model_key=r["model"], dispatcher=r["dispatcher"],
            gpus=r["gpus"], seq=r["seq"], tp=r["tp"], cp=r["cp"], ep=r["ep"], pp=r["pp"], edp=r["edp"], etp=r["etp"],
            vpp=r["vpp"], dp=r["dp"], fsdp=bool(r["fsdp"]), mbs=r["mbs"], gbs=r["gbs"], ga=r["ga"],
            recompute=str(r["recompute"]), step_time_s=step, tflops_per_gpu=tflops, derived=derived,
            notes=str(r["notes"]), code=str(r["code"])))
    return out


def model_path(m: MoeModel) -> Path:
    """The model file of ``m`` at its size, written with its SIZE set."""
    source = (MODELS_DIR / f"{m.stem}.py").read_text(encoding="utf-8")
    size = m.size
    marker = 'SIZE = "tiny"'
    if marker not in source:
        raise ValueError(f"{m.stem}.py has no line {marker}")
    return written_model_path(source.replace(marker, f'SIZE = "{size}"'), f"{m.stem}_{size.replace('-', '_')}")


def moe_graph(m: MoeModel):  # noqa: ANN201 - autopar.graph.ModelGraph
    """The model's graph at bf16, from autopar's graph cache (measured on meta on a miss)."""
    from autopar.graph.cache import cached_graph

    return cached_graph(str(model_path(m)), seq_len=None, dtype="bf16")[0]


@dataclass(frozen=True)
class MoePlan:
    """The plan closest to a row (None when skipped), what differs from the source (flags), and why a
    row is skipped."""

    plan: Any
    flags: tuple[str, ...]
    skip: str = ""


def megatron_chunk_layers(layers: int, pp: int, vpp: int, account: bool) -> list[int]:
    """Transformer layers per virtual chunk, in chunk order (chunk c on rank c % pp), as Megatron-Core
    splits them: evenly, with the embedding and the loss counted as a layer each when ``account``."""
    units = layers + (2 if account else 0)
    chunks = pp * vpp
    if units % chunks:
        raise ValueError(f"{units} layer units do not split evenly over {chunks} chunks")
    per = units // chunks
    counts = [per] * chunks
    if account:
        counts[0] -= 1
        counts[-1] -= 1
    return counts


def _ranges(counts: list[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return tuple(out)


def row_plan(row: MoeRow, model: MoeModel | None = None) -> MoePlan:
    """The plan v1 closest to ``row`` on h100-80g-megatron (module docstring), or the reason it is skipped.
    ``model``: another size of the row's model (tests map a shrunk row onto the tiny model file)."""
    from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

    m = model or row.model
    if m is None:
        return MoePlan(None, (), f"no model file here for {row.model_key}")
    if "1f1b overlap" in row.notes:
        return MoePlan(None, (), "overlaps the all-to-alls of one micro-batch with another's compute in 1F1B "
                                 "(--overlap-moe-expert-parallel-comm): a schedule autopar does not price")
    flags: list[str] = []
    zero = 3 if row.fsdp else 1
    if row.fsdp:
        flags.append("Megatron-FSDP priced as ZeRO-3")
    # sequence parallelism at tp > 1, as every Megatron run: the MoE layers route each tp rank's
    # sequence shard and the ep ranks come from dp x cp x tp, tp first (autopar.layout's folds_tp)
    pool = row.dp * row.cp * row.tp
    if row.etp > 1:
        flags.append(f"expert tp {row.etp} -> 1: the model file's stacked experts are whole on each rank")
    ep = row.ep
    if pool % ep or m.experts % ep:
        ep = max(e for e in range(1, pool + 1) if pool % e == 0 and m.experts % e == 0 and e <= row.ep)
        flags.append(f"ep {row.ep} -> {ep}: ep must divide dp x cp x tp = {pool} and the experts")
    if row.section.lower().startswith("dropless training") and "force" not in row.notes:
        flags.append("dropless routing priced balanced (moe_imbalance 1.0): the imbalance is not published")
    recompute = {"": "none", "full": "full"}.get(row.recompute.strip())
    if recompute is None:
        recompute = "none"
        flags.append(f"recompute '{row.recompute}' (norms / expert activation only) priced as none: no plan field "
                     "carries Megatron's recompute modules, their memory saving is not priced")
    vpp, stages = row.vpp, None
    if row.pp > 1:  # pipeline chunks as Megatron splits them
        counts = megatron_chunk_layers(m.layers, row.pp, row.vpp, m.account_for_embedding_and_loss)
        if min(counts) < 1:  # a chunk of only the embedding or the loss: keep each rank's layers, no interleaving
            counts = [sum(counts[c] for c in range(r, len(counts), row.pp)) for r in range(row.pp)]
            flags.append(f"vpp {row.vpp} -> 1: Megatron's first and last virtual stages hold only the embedding / "
                         "loss (a plan chunk needs a layer); each rank keeps its layers")
            vpp = 1
        if len(set(counts)) > 1:
            stages = _ranges(counts)
    plan = Plan(
        model=ModelRef(file=str(model_path(m)), num_blocks=m.layers),
        cluster=ClusterRef(profile=PROFILE, num_gpus=row.gpus, gpus_per_node=GPUS_PER_NODE),
        training=Training(global_batch_size=row.gbs, micro_batch_size=row.mbs, seq_len=row.seq, dtype="bf16",
                          optimizer="adam"),
        parallel=Parallel(dp=row.dp, tp=row.tp, pp=row.pp, cp=row.cp, ep=ep, zero=zero, sequence_parallel=row.tp > 1,
                          recompute=recompute, pp_schedule="interleaved-1f1b" if vpp > 1 else "1f1b",
                          pp_virtual_stages=vpp, stages=stages),
    )
    return MoePlan(plan, tuple(flags))


@dataclass(frozen=True)
class MoePrediction:
    """A row priced: the plan's estimate and its error against the published step time."""

    row: MoeRow
    mapped: MoePlan
    estimate: Any  # autopar.cost.estimate.Estimate, None when skipped

    @property
    def error_pct(self) -> float:
        if self.estimate is None:
            return math.nan
        return (self.estimate.step_time_s / self.row.step_time_s - 1.0) * 100.0


def predict(row: MoeRow) -> MoePrediction:
    """``row`` priced on h100-80g-megatron with the shipped constants (nothing of the row changes them)."""
    from autopar.cluster import load_cluster
    from autopar.cost.estimate import estimate_plan

    mapped = row_plan(row)
    if mapped.plan is None:
        return MoePrediction(row, mapped, None)
    est = estimate_plan(mapped.plan, moe_graph(row.model), load_cluster(PROFILE), moe_imbalance=1.0)
    return MoePrediction(row, mapped, est)
