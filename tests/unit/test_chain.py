"""Models that do not repeat one block (issue 11, point 5): the layer chain the spec finds, the
graph's per-unit measurement, the exact partition of the chain (against brute force over the cost
model), and the search and estimate of chain plans."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.chain import build_chain_terms, evaluate_chain, stage_load, stage_memory, stage_tail_s
from autopar.cost.estimate import estimate_plan
from autopar.graph import build_graph
from autopar.modelfile import load_model_file
from autopar.search.chain_search import StagePricer
from autopar.search.driver import SAMPLES_PER_GPU, default_global_batch, search_plans
from autopar.search.partition import optimal_partition
from autopar.search.space import SearchSpace, enumerate_configs
from autopar.spec import model_spec

MODELS = Path(__file__).resolve().parents[1] / "dist" / "models"
ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"
RESNET, VIT, T5 = MODELS / "chain_resnet.py", ZOO / "vit.py", ZOO / "hf_t5.py"
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")


def _ranges(L: int, P: int):
    for cuts in itertools.combinations(range(1, L), P - 1):
        b = (0, *cuts, L)
        yield tuple((b[k], b[k + 1]) for k in range(P))


def _brute(L, P, M, stage):
    best = (math.inf, None)
    for rngs in _ranges(L, P):
        costs = [stage(a, b, r) for r, (a, b) in enumerate(rngs)]
        if any(c is None for c in costs):
            continue
        f = (M - 1) * max(t for t, _ in costs) + sum(t for t, _ in costs) + max(z for _, z in costs)
        best = min(best, (f, rngs), key=lambda x: x[0])
    return best


@pytest.mark.parametrize("seed", range(40))
def test_partition_equals_brute_force_on_random_chains(seed: int) -> None:
    rng = random.Random(seed)
    L, P, M = rng.randint(1, 8), 0, rng.randint(1, 9)
    P = rng.randint(1, L)
    tau = [rng.uniform(0.1, 3.0) for _ in range(L)]
    size = [rng.uniform(0.0, 2.0) for _ in range(L)]
    p2p = [0.0] + [rng.uniform(0.0, 0.5) for _ in range(L - 1)]
    cap = rng.uniform(1.0, 6.0)

    def stage(a, b, r):
        if sum(size[a:b]) + 0.3 * (P - r) > cap:  # memory: more in flight on early ranks
            return None
        t = sum(tau[a:b]) + (p2p[a] if a else 0.0) + (p2p[b] if b < L else 0.0) + (0.7 if r == 0 else 0.0)
        return t, random.Random(seed * 10000 + a * 100 + b).uniform(0, 1) * sum(size[a:b])

    want, rngs = _brute(L, P, M, stage)
    got = optimal_partition(L, P, M, stage)
    if rngs is None:
        assert got is None
        return
    assert got is not None and got.objective_s == pytest.approx(want, rel=1e-12)
    f = _brute(L, P, M, lambda a, b, r: stage(a, b, r) if (a, b) in got.ranges else None)[0]
    assert f == pytest.approx(want, rel=1e-12)  # the returned ranges achieve the optimum
    # a threshold at the optimum prunes everything; just above it keeps the optimum, also with the
    # remaining-work bound (the units' own times: every other term is >= 0)
    rest = [sum(tau[b:]) for b in range(L + 1)]
    assert optimal_partition(L, P, M, stage, threshold=want) is None
    assert optimal_partition(L, P, M, stage, threshold=want, rest_s=rest) is None
    for r in (None, rest):
        above = optimal_partition(L, P, M, stage, threshold=want * 1.0001 + 1e-9, rest_s=r)
        assert above.objective_s == pytest.approx(want)


def test_partition_validates_its_arguments() -> None:
    with pytest.raises(ValueError):
        optimal_partition(3, 4, 2, lambda a, b, r: (1.0, 0.0))


def test_spec_reads_the_resnet_chain_in_forward_order() -> None:
    spec = model_spec(load_model_file(RESNET))
    assert spec.blocks_kind == "chain" and spec.num_blocks == 5
    assert spec.chain.units == ("layer1.0", "layer2.0", "layer2.1", "layer3.0", "layer4.0")
    # layer2.1 has layer2.0's class but not its shapes (no downsample): every unit its own kind
    assert spec.chain.kinds == (0, 1, 2, 3, 4)
    assert spec.chain.prologue == ("conv1", "bn1", "relu", "maxpool") and spec.chain.epilogue == ("avgpool", "fc")
    assert spec.support["pp"] is None and spec.support["zero3"] is None and spec.support["full"] is None
    assert "no single list of identical blocks" in spec.support["tp"] and "layer1, layer2" in spec.support["tp"]


def test_spec_cuts_sequential_vit_blocks_with_bare_parameters_on_the_first_stage() -> None:
    spec = model_spec(load_model_file(VIT))
    assert spec.blocks_kind == "Sequential" and spec.blocks_path == "blocks"
    assert spec.chain.kinds == (0, 0, 0, 0)
    assert dict(spec.chain.bare) == {"cls_token": (0,), "pos_embed": (0,)}
    assert spec.support["pp"] is None


@needs_hf
def test_spec_refuses_pp_on_encoder_decoder_with_the_reason() -> None:
    spec = model_spec(load_model_file(T5))
    assert spec.chain.units[:1] == ("encoder.block.0",) and spec.chain.units[-1] == "decoder.block.3"
    assert spec.num_blocks == 8 and spec.support["zero3"] is None
    assert spec.support["pp"].startswith("decoder.block.0: ") and "encoder output" in spec.support["pp"]


def test_spec_reads_one_list_of_differing_blocks_as_a_block_list_for_pp() -> None:
    # dense, dense, moe, moe in one ModuleList, each block reading a mask and a position table
    # beside its input: the chain pipeline would refuse; the block-list pipeline cuts it
    spec = model_spec(load_model_file(MODELS / "mixed_blocks.py"))
    assert spec.blocks_kind == "chain" and spec.chain.block_list == "layers" and spec.blocks_path == "layers"
    assert spec.chain.kinds == (0, 0, 2, 2)
    assert spec.support["pp"] is None and spec.support["zero3"] is None
    assert model_spec(load_model_file(RESNET)).chain.block_list is None  # four stage lists: cut at unit inputs


def test_a_list_of_differing_blocks_called_out_of_order_or_twice_is_refused_pp(tmp_path: Path) -> None:
    src = (MODELS / "mixed_blocks.py").read_text()
    loop = "        for layer in self.layers:\n            h = layer(h, mask=mask, pos=pos)\n"
    assert loop in src
    cases = {
        "reversed": ("        for layer in reversed(self.layers):\n            h = layer(h, mask=mask, pos=pos)\n",
                     "reads tensors beside its input"),
        "twice": (loop + loop, "more than once"),
    }
    for name, (body, why) in cases.items():
        path = tmp_path / f"mixed_{name}.py"
        path.write_text(src.replace(loop, body))
        spec = model_spec(load_model_file(path))
        assert spec.support["pp"] is not None and why in spec.support["pp"], (name, spec.support["pp"])


@needs_hf
def test_tiny_deepseek_v3_plans_with_pp_offered_and_its_blocks_split() -> None:
    mf = load_model_file(ZOO / "hf_deepseek_v3.py")
    assert model_spec(mf).chain.block_list == "model.layers"
    found = search_plans(mf, gpus=8, cluster=load_cluster("a100-80g"), cluster_ref="a100-80g", top_k=50)
    pp_plans = [p for p in found.plans if p.parallel.pp > 1]
    assert pp_plans and all(p.stage_ranges()[-1][1] == 4 for p in pp_plans)


@functools.lru_cache(maxsize=None)
def _resnet_graph():
    return build_graph(load_model_file(RESNET), dtype="bf16")


def test_graph_measures_each_unit_of_the_chain() -> None:
    g = _resnet_graph()
    assert [u.name for u in g.chain] == list(model_spec(load_model_file(RESNET)).chain.units)
    mf = load_model_file(RESNET)
    model = mf.build("meta")
    for u in g.chain:  # each unit's own parameters
        assert u.params == sum(p.numel() for p in model.get_submodule(u.name).parameters())
    assert g.num_params == sum(p.numel() for p in model.parameters())
    # the stem halves the image twice: layer1 gets 32 x 4 x 4 channels-by-pixels in bf16 at one sample
    assert g.chain[0].input_bytes == 8 * 4 * 4 * 2
    assert g.chain[3].input_bytes == 64 * 2 * 2 * 2  # after layer2's stride 2: 64 channels, 2 x 2
    flops = [g.regions[u.region].ops for u in g.chain]
    assert all(flops), "every unit has ops"


def test_chain_partition_equals_brute_force_over_the_cost_model() -> None:
    g = _resnet_graph()
    cluster = dataclasses.replace(load_cluster("a100-80g"))
    space = SearchSpace(num_gpus=4, gpus_per_node=4, global_batch=32, seq_len=1, micro_batches=(1, 4))
    checked = 0
    for cfg in enumerate_configs(g, space, Counter()):
        if cfg.pp == 1 or cfg.virtual_stages > 1:
            continue
        terms = build_chain_terms(g, cluster, cfg)
        # the pricer's O(1) sums are cost/chain.py's stage costs
        for rngs in _ranges(g.num_blocks, cfg.pp):
            for r, (a, b) in enumerate(rngs):
                load = stage_load(terms, a, b, r)
                t, z = StagePricer(terms)(a, b, r)
                assert t == pytest.approx(load.time_s, rel=1e-9) and z == pytest.approx(stage_tail_s(terms, load), rel=1e-9)
                fast = dataclasses.asdict(StagePricer(terms).load(a, b, r))
                assert fast == pytest.approx(dataclasses.asdict(load), rel=1e-9)
                mem = stage_memory(terms, load, r)
                # the states, the in-flight activations, and at least the units' backward phase
                assert sum(mem.values()) >= (load.params * terms.base.state_bytes_per_param
                                             + terms.base.inflight(r) * load.act_bytes + load.transient_bytes
                                             + terms.base.reserve_bytes) * (1 - 1e-9)
        best = min(evaluate_chain(terms, rngs, 1.0, 1.0, cluster.peak_flops).step_time_s for rngs in _ranges(g.num_blocks, cfg.pp))
        part = optimal_partition(g.num_blocks, cfg.pp, cfg.num_microbatches, StagePricer(terms))
        assert part.objective_s == pytest.approx(best, rel=1e-9)
        assert evaluate_chain(terms, part.ranges, 1.0, 1.0, cluster.peak_flops).step_time_s == pytest.approx(best, rel=1e-9)
        checked += 1
    assert checked >= 8


def test_chain_memory_limit_shapes_the_partition() -> None:
    """With room for little more than half the model per GPU, only balanced partitions fit, and the DP
    finds exactly the fitting one brute force finds."""
    g = _resnet_graph()
    base = load_cluster("a100-80g")
    space = SearchSpace(num_gpus=2, gpus_per_node=2, global_batch=8, seq_len=1, micro_batches=(1,))
    cfg = next(c for c in enumerate_configs(g, space, Counter()) if c.pp == 2 and c.schedule == "1f1b")
    terms = build_chain_terms(g, base, cfg)
    peaks = {rngs: evaluate_chain(terms, rngs, 1.0, 1.0, 1.0).peak_memory_bytes for rngs in _ranges(5, 2)}
    cap = sorted(peaks.values())[1]  # two partitions fit
    tight = dataclasses.replace(base, memory_margin_fraction=0.0, memory_bytes=cap)
    terms = build_chain_terms(g, tight, cfg)
    fitting = [r for r, p in peaks.items() if p <= cap]
    best = min(fitting, key=lambda r: evaluate_chain(terms, r, 1.0, 1.0, 1.0).step_time_s)
    part = optimal_partition(5, 2, cfg.num_microbatches, StagePricer(terms))
    assert part.ranges in fitting and evaluate_chain(terms, part.ranges, 1.0, 1.0, 1.0).step_time_s == pytest.approx(
        evaluate_chain(terms, best, 1.0, 1.0, 1.0).step_time_s)
    nothing = dataclasses.replace(base, memory_margin_fraction=0.0, memory_bytes=min(peaks.values()) - 1)
    assert optimal_partition(5, 2, cfg.num_microbatches, StagePricer(build_chain_terms(g, nothing, cfg))) is None


def test_default_global_batch_of_a_model_without_a_sequence_is_in_samples() -> None:
    assert default_global_batch(64, 1) == SAMPLES_PER_GPU * 64 == 2048
    assert default_global_batch(64, 2048) == 2048  # 4M tokens of a sequence model, unchanged


@pytest.mark.parametrize("path", [RESNET, VIT], ids=["resnet", "vit"])
def test_chain_and_sequential_models_plan_at_64_gpus_with_pp_offered(path: Path) -> None:
    mf = load_model_file(path)
    cluster = load_cluster("a100-80g")
    found = search_plans(mf, gpus=64, cluster=cluster, cluster_ref="a100-80g", top_k=200, dtype="fp32")
    assert found.space.global_batch == 2048
    pp_plans = [p for p in found.plans if p.parallel.pp > 1]
    assert pp_plans, "PP is offered and costed"
    assert {p.parallel.zero for p in found.plans} >= {0, 3}
    for plan in found.plans[:3] + tuple(pp_plans[:3]):
        assert plan.model.num_blocks == found.graph.num_blocks
        est = estimate_plan(plan, found.graph, found.cluster)  # estimate agrees with the search
        assert est.step_time_s == pytest.approx(plan.prediction["step_time_s"], rel=1e-9)
        if plan.parallel.pp > 1:
            ranges = plan.stage_ranges()
            assert ranges[0][0] == 0 and ranges[-1][1] == found.graph.num_blocks


@pytest.mark.parametrize("seed", range(10))
def test_pareto_front_equals_the_quadratic_definition(seed: int) -> None:
    from autopar.search.partition import _pareto

    rng = random.Random(seed)
    items = [(rng.randint(0, 6), rng.randint(0, 6), rng.randint(0, 6), i, 0) for i in range(60)]
    got = _pareto(list(items))
    want = [x for k, x in enumerate(items) if not any(
        (y[0] <= x[0] and y[1] <= x[1] and y[2] <= x[2]) and (y[:3] != x[:3] or j < k) for j, y in enumerate(items) if j != k)]
    assert sorted(x[:3] for x in got) == sorted(x[:3] for x in want)


def test_a_pipeline_chunks_block_list_indexes_its_own_blocks() -> None:
    """nn.TransformerEncoder reads self.layers[0] (fast-path checks) on every stage: on a later
    stage's chunk the integer index must give the chunk's first block, not a missing key '0' or a
    marker, while iteration still runs the markers."""
    from torch import nn

    from autopar.executor.parallel.pipeline_parallel import _ChunkBlocks

    blocks = _ChunkBlocks()
    marker, b2, b3 = nn.Identity(), nn.Linear(2, 2), nn.Linear(2, 2)
    blocks.add_module("inject", marker)
    blocks.add_module("2", b2)
    blocks.add_module("3", b3)
    assert blocks[0] is b2 and blocks[-1] is b3
    assert list(blocks) == [marker, b2, b3] and len(blocks) == 3
    assert list(blocks[1:]) == [b2, b3]  # slices keep every child (HF: self.layers[:num_hidden_layers])
