"""Published peak memory of real runs (``calibration/memory_public.yaml``) as plans, for the memory
model: each row's model as a model file of its architecture, its configuration as a plan v1 on the
software profile it ran with, and its published peak (``kind``: allocated, the step's tensors).

The Megatron-LM functional-test GPT (GQA, LayerNorm, GeLU MLP, learned position embeddings,
dropout 0.1, untied head) is ``megatron_gpt_model_file``: ``autopar.models.llama``'s grouped-query
attention with those layers around it; its linear biases are left out (0.2 % of the parameters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from autopar.models.llama import LlamaConfig
from autopar.reference import load_calibration, written_model_path


@dataclass(frozen=True, kw_only=True)
class MegatronGPTConfig(LlamaConfig):
    """A Megatron-LM GPT with grouped-query attention (the functional tests' 7B)."""

    dropout: float = 0.1


def megatron_gpt_model_file(cfg: MegatronGPTConfig) -> str:
    """A model file (docs/models.md) for a Megatron GPT with GQA: LayerNorm, GeLU MLP of width ffn,
    learned absolute position embeddings added to the token embeddings, hidden dropout after the
    attention and the MLP, an untied output layer."""
    base = LlamaConfig(**{f: getattr(cfg, f) for f in LlamaConfig.__dataclass_fields__})
    return f'''"""Megatron GPT with grouped-query attention: {cfg!r}"""
import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import example_tokens, next_token_loss
from autopar.models.llama import LlamaAttention, LlamaConfig

CONFIG = {base!r}
DROPOUT = {cfg.dropout!r}
SEQ_LEN = CONFIG.seq_len
tp_plan = {{"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
           "attention.wo": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}}
pipeline_blocks = "layers"


class MLP(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.fc1 = nn.Linear(h, f, bias=False)
        self.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.hidden_size)
        self.attention = LlamaAttention(cfg)
        self.drop1 = nn.Dropout(DROPOUT)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg.hidden_size, cfg.ffn_hidden_size)
        self.drop2 = nn.Dropout(DROPOUT)

    def forward(self, x, positions=None):
        x = x + self.drop1(self.attention(self.attention_norm(x), positions))
        return x + self.drop2(self.mlp(self.ffn_norm(x)))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens, positions=None):
        pos = positions if positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h, positions)
        return self.output(self.norm(h))


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size: int):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
'''


@dataclass(frozen=True, kw_only=True)
class MemoryRun:
    """One published peak: its run as a plan, the stage it was measured on, and the figure."""

    group: str
    name: str
    case: str
    model: MegatronGPTConfig
    software: dict
    num_gpus: int
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    micro_batch: int
    global_batch: int
    sequence_parallel: bool
    recompute: str
    stage: int  # the pipeline rank whose memory was reported
    peak_allocated_bytes: float
    resident_allocated_bytes: float

    @property
    def model_path(self) -> Path:
        return written_model_path(megatron_gpt_model_file(self.model), "megatron_gpt")


def memory_runs() -> list[MemoryRun]:
    """The rows of memory_public.yaml with a published peak, in file order."""
    data = load_calibration("memory_public.yaml")
    out = []
    for group, body in data.items():
        m = body["model"]
        cfg = MegatronGPTConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_heads=m["heads"],
                                num_kv_heads=m["kv_heads"], ffn_hidden_size=m["ffn"], seq_len=m["seq"],
                                vocab_size=m["vocab"], dropout=m.get("dropout", 0.0))
        for r in body["rows"]:
            pub = r["published"]
            out.append(MemoryRun(
                group=group, name=r["name"], case=r["case"], model=cfg, software=dict(body.get("software", {})),
                num_gpus=r["gpus"], tp=r["tp"], pp=r["pp"], dp=r["dp"], virtual_stages=r.get("vp") or 1,
                micro_batch=r["mbs"], global_batch=r["gbs"], sequence_parallel=bool(r.get("sp", False)),
                recompute=r["recompute"], stage=r["stage"], peak_allocated_bytes=float(pub["peak_allocated_bytes"]),
                resident_allocated_bytes=float(pub["resident_allocated_bytes"])))
    return out


def memory_plan(run: MemoryRun):  # noqa: ANN201 - returns autopar.plan.Plan
    """The run's configuration as a plan v1 on h100-80g-megatron (Megatron's distributed optimizer
    is ZeRO-1 over dp x cp)."""
    from autopar.plan import ClusterRef, ModelRef, Parallel, Plan, Training

    v = run.virtual_stages
    return Plan(
        model=ModelRef(file=str(run.model_path), num_blocks=run.model.num_layers),
        cluster=ClusterRef(profile="h100-80g-megatron", num_gpus=run.num_gpus, gpus_per_node=8),
        training=Training(global_batch_size=run.global_batch, micro_batch_size=run.micro_batch,
                          seq_len=run.model.seq_len, dtype="bf16", optimizer="adam"),
        parallel=Parallel(dp=run.dp, tp=run.tp, pp=run.pp, zero=1, sequence_parallel=run.sequence_parallel,
                          recompute=run.recompute, pp_schedule="interleaved-1f1b" if v > 1 else "1f1b",
                          pp_virtual_stages=v),
    )


def memory_cluster(run: MemoryRun):  # noqa: ANN201 - returns autopar.cluster.Cluster
    """h100-80g-megatron with the run's own software settings (its gradient buffer dtype, whether
    TP communication overlapped): settings of the run, as its micro-batch is, never fitted."""
    from autopar.cluster import load_cluster

    return dataclasses.replace(load_cluster("h100-80g-megatron"), **run.software)


def predicted_peak_bytes(run: MemoryRun) -> tuple[float, float]:
    """(the cost model's tensor peak on the reported stage -- its peak less what no tensor holds,
    which an allocated figure excludes --, its model states there)."""
    from autopar.cost.estimate import estimate_plan
    from autopar.graph import build_graph

    plan = memory_plan(run)
    est = estimate_plan(plan, build_graph(str(run.model_path), dtype="bf16"), memory_cluster(run))
    stage = est.ranks[run.stage]
    states = sum(stage.memory_bytes[k] for k in ("params", "grads", "optimizer"))
    return stage.peak_bytes - est.reserve_bytes, states
