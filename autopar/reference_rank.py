"""Ranking against published measurements: does the cost model order configurations as they ran?

A planner sells a ranking: of the configurations it never saw measured, which is fastest. Where one
public source measured several configurations of the same model on the same hardware, the predicted
order is compared with the measured one by Kendall's tau (tau-a: concordant minus discordant pairs
over all pairs; a predicted tie counts as neither):

* Korthikanti et al. 2022, Table 4: one layer of the 22B model on 8 A100s in five settings (no
  recompute, sequence parallelism, full recompute, selective recompute, selective + sequence
  parallelism), forward + backward milliseconds; priced with ``a100-80g-megatron``.
* NVIDIA's dgxc recipes: Nemotron-4 15B on 16 H100s at tp 2 and tp 4 (same GPUs, batch and
  sequence), step time; priced with ``h100-80g-megatron``.
* torchtitan's Llama 3.1 8B with FSDP2 on 8 and 128 H100s: throughput per GPU (the step times are
  of different GPU counts); priced with ``h100-80g`` (the runs' 500 W GPUs are slower: the order,
  not the level, is what counts here).
* NVIDIA's dgxc Llama 3.1 recipes, each model at its smallest and largest published scale (8B on 8
  and 128 H100s, 70B on 64 and 2,048, 405B on 576 and 2,304; context parallelism 2): throughput per
  GPU, which falls by 1.4-2.4 % with scale; priced with ``h100-80g-megatron``.

These are every multi-configuration set in ../shared/calibration; each further public sweep (a tp/pp
grid, a micro-batch sweep) is one more entry of ``ranked_sources``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

__all__ = ["RankedSource", "kendall_tau", "ranked_sources"]


@dataclass(frozen=True, kw_only=True)
class RankedSource:
    """One source's configurations: names, the published and the predicted figure of each (same
    unit), and whether a larger figure is better (throughput) or worse (time)."""

    source: str
    quantity: str
    names: tuple[str, ...]
    published: tuple[float, ...]
    predicted: tuple[float, ...]
    higher_is_better: bool = False

    @property
    def tau(self) -> float:
        return kendall_tau(self.predicted, self.published)

    @property
    def pairs(self) -> tuple[int, int]:
        """(pairs ordered as measured, all pairs)."""
        n = len(self.names)
        agree = sum(1 for i, j in combinations(range(n), 2)
                    if (self.predicted[i] - self.predicted[j]) * (self.published[i] - self.published[j]) > 0)
        return agree, n * (n - 1) // 2


def kendall_tau(predicted: Sequence[float], published: Sequence[float]) -> float:
    """Kendall's tau-a of two equally long sequences: (concordant - discordant) / pairs; a pair tied in
    either counts as neither. 1: the same order, -1: reversed."""
    if len(predicted) != len(published) or len(predicted) < 2:
        raise ValueError("kendall_tau needs two sequences of the same length, at least 2")
    score = 0
    pairs = list(combinations(range(len(predicted)), 2))
    for i, j in pairs:
        s = (predicted[i] - predicted[j]) * (published[i] - published[j])
        score += (s > 0) - (s < 0)
    return score / len(pairs)


def _table4() -> RankedSource:
    from autopar.cluster import load_cluster
    from autopar.cost.stage import Config, build_terms
    from autopar.reference import KORTHIKANTI_22B, TABLE4_MODES, gpt_graph, load_calibration

    cluster, graph = load_cluster("a100-80g-megatron"), gpt_graph(KORTHIKANTI_22B, "fp16")
    rows = load_calibration("korthikanti_2022.yaml")["table4_one_layer_of_22B_model_ms"]["rows"]
    predicted = []
    for name, *_ in rows:
        sp, recompute = TABLE4_MODES[name]
        cfg = Config(dp=1, tp=8, pp=1, cp=1, cp_kind="ring", sequence_parallel=sp, zero=0, recompute=recompute,
                     schedule="1f1b", virtual_stages=1, micro_batch=4, global_batch=4, seq_len=2048,
                     dtype_bytes=2, optimizer="adam")
        block = build_terms(graph, cluster, cfg).block
        predicted.append((block.fwd_s + block.bwd_s) * 1e3)
    return RankedSource(source="Korthikanti 2022 Table 4 (22B layer, 8 A100)", quantity="fwd+bwd ms",
                        names=tuple(r[0] for r in rows), published=tuple(float(r[3]) for r in rows),
                        predicted=tuple(predicted))


def _public(source: str, group: str, names: Sequence[str], per_gpu_throughput: bool) -> RankedSource:
    from autopar.cost.estimate import estimate_plan
    from autopar.reference_h100 import public_plan, public_runs, run_graph, software_cluster

    runs = {r.name: r for r in public_runs(group)}
    published, predicted = [], []
    for name in names:
        run = runs[name]
        cluster, profile = software_cluster(run)
        step_s = estimate_plan(public_plan(run, profile), run_graph(run), cluster).step_time_s
        if per_gpu_throughput:  # tokens per second per GPU: comparable across GPU counts
            tokens = run.global_batch * run.seq_len / run.num_gpus
            published.append(tokens / run.step_time_s)
            predicted.append(tokens / step_s)
        else:
            published.append(run.step_time_s)
            predicted.append(step_s)
    return RankedSource(source=source, quantity="tokens/s per GPU" if per_gpu_throughput else "step s",
                        names=tuple(names), published=tuple(published), predicted=tuple(predicted),
                        higher_is_better=per_gpu_throughput)


def ranked_sources() -> list[RankedSource]:
    """Every multi-configuration source (module docstring), priced by the shipped profiles."""
    return [
        _table4(),
        _public("dgxc Nemotron-4 15B, 16 H100 (tp 2, tp 4)", "dgxc",
                ["nemotron4-15b-16-tp2", "nemotron4-15b-16-tp4"], per_gpu_throughput=False),
        _public("torchtitan Llama 3.1 8B FSDP2 (8, 128 H100)", "torchtitan",
                ["llama3.1-8b-fsdp8", "llama3.1-8b-fsdp128"], per_gpu_throughput=True),
        *(_public(f"dgxc Llama 3.1 {size} cp 2 ({a}, {b} H100)", "dgxc_llama31",
                  [f"llama3.1-{size.lower()}-{a}", f"llama3.1-{size.lower()}-{b}"], per_gpu_throughput=True)
          for size, a, b in (("8B", 8, 128), ("70B", 64, 2048), ("405B", 576, 2304))),
    ]
