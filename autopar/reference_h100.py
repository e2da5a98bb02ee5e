"""Published H100 pre-training runs (``h100_public.yaml``) as plans, for calibration and plan quality.

Every row of the file becomes a ``PublicRun``: the model as a model file of its architecture (what
is used, and how it differs from the published model, is stated in ``stand_in``), the published
configuration as a plan v1, and the published step time:

- GPT-3 / Megatron GPT / MPT: ``autopar.models.gpt`` with the fused (flash) attention core, which
  Transformer Engine and llm-foundry run; MPT has no dropout.
- Nemotron-4 (LayerNorm, squared-ReLU MLP of width ffn, not gated, RoPE, GQA, untied head): a model
  file built from ``autopar.models.llama``'s attention (GQA, RoPE) with LayerNorm and a squared-ReLU
  MLP swapped in (``nemotron_model_file``) -- the architecture itself, not a FLOP-equivalent.
- Llama 3.1: ``autopar.models.llama`` as it is.

Where the source does not state a setting (Megatron-Core's weak-scaling table: micro-batch,
interleaving, recompute), the assumption is stated on the row (``assumed``) and is the same
rule for every row, never chosen per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from autopar.graph import ModelGraph, build_graph
from autopar.models import gpt, llama
from autopar.reference import load_calibration, written_model_path

GROUPS = ("dgxc", "megatron_core_r08", "llm_foundry", "torchtitan", "dgxc_llama31")


@dataclass(frozen=True, kw_only=True)
class PublicRun:
    """One published run: its group in h100_public.yaml, model, configuration and step time."""

    group: str
    name: str
    model: gpt.GPTConfig | llama.LlamaConfig
    stand_in: str  # the model file used for the published architecture
    num_gpus: int
    global_batch: int
    micro_batch: int
    seq_len: int
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    cp: int = 1  # context parallelism (the dgxc Llama 3.1 recipes: Transformer Engine's P2P ring)
    zero: int
    sequence_parallel: bool
    recompute: str
    step_time_s: float  # published (or derived from published tokens/s or TFLOP/s, see ``derived``)
    derived: str = ""
    assumed: tuple[str, ...] = field(default=())
    software: str = "megatron"  # megatron | fsdp: what the run's framework overlaps (profiles/*-megatron.yaml)
    tp_comm_overlap: bool | None = None  # False: the source says this run had TP communication overlap off
    # NeMo's optimizer as the run's config names it: (optim name, state dtype); None: Megatron's
    # distributed optimizer with fp32 state (``nemo_optimizer_precision``)
    nemo_optimizer: tuple[str, str] | None = None
    # Peak device memory the source reports (torchtitan's max_reserved GiB), bytes; None: not reported
    published_peak_bytes: float | None = None
    # Per-stage recompute counts (none, selective, full) per pipeline rank (plan recompute_blocks):
    # torchtitan's "selective layer" checkpointing, every Nth block fully; None: ``recompute`` everywhere
    recompute_blocks: tuple[tuple[int, int, int], ...] | None = None

    @property
    def layout(self) -> str:
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        c = f" cp{self.cp}" if self.cp > 1 else ""
        return f"{self.tp}/{self.pp}/{self.dp}{v}{c}"


@dataclass(frozen=True, kw_only=True)
class NemotronConfig(llama.LlamaConfig):
    """Nemotron-4: Llama's GQA + RoPE attention, LayerNorm, squared-ReLU MLP (ffn_hidden_size wide)."""


def nemotron_model_file(cfg: NemotronConfig) -> str:
    """A model file (docs/design.md §3) for a Nemotron-4 architecture."""
    base = llama.LlamaConfig(**{f: getattr(cfg, f) for f in llama.LlamaConfig.__dataclass_fields__})
    return f'''"""Nemotron-4 (LayerNorm, squared-ReLU MLP, GQA, RoPE): {cfg!r}"""
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import example_tokens, next_token_loss
from autopar.models.llama import LLAMA_TP_PLAN, Llama, LlamaConfig

CONFIG = {base!r}
SEQ_LEN = CONFIG.seq_len
tp_plan = {{k: v for k, v in LLAMA_TP_PLAN.items() if k != "feed_forward.w3"}}
pipeline_blocks = "layers"


class SquaredReLU(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)).square())


def build_model():
    m = Llama(CONFIG)
    h, f = CONFIG.hidden_size, CONFIG.ffn_hidden_size
    for blk in m.layers:
        blk.attention_norm, blk.ffn_norm = nn.LayerNorm(h), nn.LayerNorm(h)
        blk.feed_forward = SquaredReLU(h, f)
    m.norm = nn.LayerNorm(h)
    return m


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
'''


def model_path(cfg: gpt.GPTConfig | llama.LlamaConfig) -> Path:
    if isinstance(cfg, NemotronConfig):
        return written_model_path(nemotron_model_file(cfg), "nemotron")
    if isinstance(cfg, llama.LlamaConfig):
        return written_model_path(llama.model_file(cfg), "llama")
    return written_model_path(gpt.model_file(cfg), "gpt")


def run_graph(run: PublicRun) -> ModelGraph:
    return build_graph(str(model_path(run.model)), dtype="bf16")


def _model(m: dict, seq: int) -> tuple[gpt.GPTConfig | llama.LlamaConfig, str]:
    arch = str(m.get("arch", "gpt"))
    kv = m.get("kv_heads", m["heads"])
    if arch.startswith("gpt-like"):  # Nemotron-4
        return (NemotronConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_heads=m["heads"], num_kv_heads=kv,
                               ffn_hidden_size=m["ffn"], seq_len=seq, vocab_size=m["vocab"]),
                f"nemotron (LayerNorm, squared ReLU, GQA {kv}, RoPE)")
    if arch == "llama":
        return (llama.LlamaConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_heads=m["heads"], num_kv_heads=kv,
                                  ffn_hidden_size=m["ffn"], seq_len=seq, vocab_size=m["vocab"]), "llama")
    return (gpt.GPTConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_heads=m["heads"], seq_len=seq,
                          vocab_size=m["vocab"], ffn_hidden_size=m.get("ffn"), fused_attention=True,
                          dropout=m.get("dropout", 0.1)), "gpt (fused attention)")


def dict_rows(group: str, data: dict) -> list[PublicRun]:
    """The rows of a group written as mappings (one per run: model, configuration, published figure)."""
    out = []
    for r in data["rows"]:
        seq = r["model"]["seq"]
        model, stand_in = _model(r["model"], seq)
        pub = r["published"]
        tokens = r["gbs"] * seq
        if "step_time_s" in pub:
            step, derived = float(pub["step_time_s"]), ""
        else:
            step, derived = tokens / (pub["tokens_per_s_per_gpu"] * r["gpus"]), "gbs seq / tokens/s"
        out.append(PublicRun(
            group=group, name=r["name"], model=model, stand_in=stand_in, num_gpus=r["gpus"], global_batch=r["gbs"],
            micro_batch=r["mbs"], seq_len=seq, tp=r["tp"], pp=r["pp"], dp=r["dp"], virtual_stages=r.get("vp") or 1,
            cp=int(r.get("cp") or 1),
            zero=r["zero"], sequence_parallel=bool(r.get("sp", False)), recompute=r["recompute"], step_time_s=step,
            derived=derived, assumed=tuple(r.get("inferred", ())), software="megatron" if r["zero"] < 3 else "fsdp",
            tp_comm_overlap=False if "no TP comm overlap" in str(r.get("notes", "")) else None,
            nemo_optimizer=(str(r["optimizer"]["name"]), str(r["optimizer"].get("dtype", "fp32")))
            if "optimizer" in r else None,
            published_peak_bytes=float(pub["peak_memory_gib"]) * 2**30 if "peak_memory_gib" in pub else None,
            recompute_blocks=tuple(tuple(map(int, b)) for b in r["recompute_blocks"]) if "recompute_blocks" in r else None))
    return out


def megatron_core_flops_per_step(layers: int, hidden: int, seq: int, vocab: int, batch: int) -> float:
    """Megatron-LM's model FLOPs per step (training.py, dense GPT, ffn 4h, kv = heads, no recompute):
    72 B s L h^2 (1 + s / (6 h) + V / (12 L h)) -- the count behind the README's TFLOP/s."""
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


# Megatron-Core's table states no micro-batch, interleaving or recompute: one rule for every row,
# the least assumed -- micro-batch 1, no recompute, SP on, plain 1F1B (no interleaving).
MCORE_LAYERS_PER_VIRTUAL_STAGE = 0  # 0: no interleaving; n: n layers per virtual stage where it divides


def _mcore_rows(data: dict) -> list[PublicRun]:
    out = []
    seq, vocab = 4096, 131072
    for name, layers, hidden, heads, gpus, gbs, tp, pp, dp, tflops in data["rows"]:
        model = gpt.GPTConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, seq_len=seq, vocab_size=vocab,
                              fused_attention=True)
        step = megatron_core_flops_per_step(layers, hidden, seq, vocab, gbs) / (tflops * 1e12 * gpus)
        per_stage = layers // pp
        n = MCORE_LAYERS_PER_VIRTUAL_STAGE
        v = per_stage // n if n and pp > 1 and per_stage % n == 0 else 1
        out.append(PublicRun(
            group="megatron_core_r08", name=name, model=model, stand_in="gpt (fused attention)", num_gpus=gpus,
            global_batch=gbs, micro_batch=1, seq_len=seq, tp=tp, pp=pp, dp=dp, virtual_stages=max(1, v), zero=1,
            sequence_parallel=tp > 1, recompute="none", step_time_s=step, derived="Megatron FLOPs / TFLOP/s",
            assumed=("micro_batch 1", "no recompute", "sp", "1f1b" if v == 1 else f"v{v}")))
    return out


def _foundry_rows(data: dict) -> list[PublicRun]:
    out = []
    for name, layers, hidden, heads, seq, gpus, gbs, mbs, recompute, tps in data["rows"]:
        model = gpt.GPTConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, seq_len=seq, vocab_size=50368,
                              fused_attention=True, dropout=0.0)
        out.append(PublicRun(
            group="llm_foundry", name=name, model=model, stand_in="gpt (fused attention, no dropout)", num_gpus=gpus,
            global_batch=gbs, micro_batch=mbs, seq_len=seq, tp=1, pp=1, dp=gpus, virtual_stages=1, zero=3,
            sequence_parallel=False, recompute=recompute, step_time_s=gbs * seq / (tps * gpus),
            derived="gbs seq / tokens/s", software="fsdp"))
    return out


def public_runs(group: str | None = None) -> list[PublicRun]:
    """The rows of h100_public.yaml as runs (one group, or all in file order)."""
    data = load_calibration("h100_public.yaml")
    runs = (dict_rows("dgxc", data["dgxc"]) + _mcore_rows(data["megatron_core_r08"])
            + _foundry_rows(data["llm_foundry"]) + dict_rows("torchtitan", data["torchtitan"])
            + dict_rows("dgxc_llama31", data["dgxc_llama31"]))
    return [r for r in runs if group is None or r.group == group]


def public_plan(run: PublicRun, profile: str):  # noqa: ANN201 - returns autopar.plan.Plan
    """The published configuration of ``run`` as a plan v1 on ``profile``."""
    from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

    v = run.virtual_stages
    return Plan(
        model=ModelRef(file=str(model_path(run.model)), num_blocks=run.model.num_layers),
        cluster=ClusterRef(profile=profile, num_gpus=run.num_gpus, gpus_per_node=8),
        training=Training(global_batch_size=run.global_batch, micro_batch_size=run.micro_batch, seq_len=run.seq_len,
                          dtype="bf16", optimizer="adam"),
        parallel=Parallel(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, zero=run.zero, sequence_parallel=run.sequence_parallel,
                          recompute=run.recompute, pp_schedule="interleaved-1f1b" if v > 1 else "1f1b",
                          pp_virtual_stages=v, recompute_blocks=run.recompute_blocks),
    )


PROFILES = {"megatron": "h100-80g-megatron", "fsdp": "h100-80g"}

# The H100 96 GB HBM2e of torchtitan's Grand Teton hosts: six 16 GiB stacks (98,304 MiB) where the
# 80 GB part has five (81,920 MiB). The 80 GB part gives a process 81,082 MiB (torch's total_memory,
# profiles/h100-80g.yaml); the same share of six stacks is 97,298 MiB (95.0 GiB), the device memory
# a torchtitan run there had. Only the capacity differs from h100-80g here: the run's time is
# informational (a 500 W part of unknown clocks).
GRAND_TETON_MEMORY_BYTES = 98304 * 81082 // 81920 * 2**20


def nemo_optimizer_precision(name: str, dtype: str) -> tuple[float, float | None]:
    """(bytes per Adam moment element, bytes per parameter of the master copy; None: fp32) of NeMo
    1.x / 24.x's optimizer ``name`` with ``optim.dtype`` ``dtype``, for a bf16 model (megatron_amp_O2).
    NeMo's MegatronBaseModel.setup_optimization (v2.0.0, the 24.09 container) gives Apex's
    DistributedFusedAdam its state dtype from ``optim.dtype`` (default fp32) and, training in bf16,
    keeps no master copy when that dtype is the model's (store_params False) or only the fp32
    master's low 16 bits when it is fp32 (store_param_remainders). ``mcore_distributed_optim`` is
    Megatron-Core's distributed optimizer: fp32 master and moments."""
    if name != "distributed_fused_adam":
        return 4.0, None
    if dtype in ("bf16", "bfloat16"):
        return 2.0, 0.0
    return 4.0, 2.0


def software_cluster(run: PublicRun):  # noqa: ANN201 - returns (autopar.cluster.Cluster, profile name)
    """The H100 profile of the software ``run`` used, with the run's stated settings: Megatron-Core
    runs on h100-80g-megatron, PyTorch FSDP runs on h100-80g; a run that states it had TP
    communication overlap off (the 340B recipe) gets that switch off, llm-foundry's runs their bf16
    gradient reduction (h100-80g prices autopar run's fp32), torchtitan's its 96 GB device memory
    (``GRAND_TETON_MEMORY_BYTES``), a run whose config names NeMo's
    optimizer its state precision -- settings of the run, as its recompute or micro-batch are,
    never fitted terms."""
    import dataclasses

    from autopar.cluster import load_cluster

    profile = PROFILES[run.software]
    cluster = load_cluster(profile)
    if run.tp_comm_overlap is False:
        cluster = dataclasses.replace(cluster, tp_comm_overlap=False)
    if run.group == "llm_foundry":
        # its H100 benchmark sweep trains with fsdp_config mixed_precision PURE (llm-foundry
        # scripts/train/benchmarking): parameters, gradients and their reduce-scatter in bf16
        cluster = dataclasses.replace(cluster, grad_reduce_bytes=2)
    if run.group == "torchtitan":
        cluster = dataclasses.replace(cluster, memory_bytes=GRAND_TETON_MEMORY_BYTES)
    if run.nemo_optimizer is not None:
        moment, master = nemo_optimizer_precision(*run.nemo_optimizer)
        cluster = dataclasses.replace(cluster, optimizer_moment_bytes=moment, master_weight_bytes=master)
    return cluster, profile
