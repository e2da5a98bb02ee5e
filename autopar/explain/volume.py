"""Communication volume of one training step, per collective and mesh axis, for each pipeline rank.

Everything is derived from the cost model's own inputs (``cost.stage.build_terms`` and the graph's
fitted collective messages), so the volume table describes exactly the traffic the estimate costs.
Notation: M micro-batches per step, b micro-batch, d bytes of the training dtype, n_r blocks on
pipeline rank r, X = one block input of one micro-batch on one rank (``graph.block_input_bytes * b
* s/cp``: b·s/cp·h·d for a transformer), KV = this rank's K and V (2·X·kv_heads/heads / tp), P_r =
parameters held by a rank of stage r (tp-sharded), n = the group size of the axis.

Calls per step on one rank of pipeline rank r, and the message (full, unsharded tensor) of each:

    TP   (tp > 1)  per block message q recorded while tracing (Megatron: 2 forward, 2 backward, each X):
                   no SP: all-reduce q            fwd n_r·M calls, bwd n_r·M calls
                   SP:    all-gather q + reduce-scatter q instead of each all-reduce
                   full recompute repeats the forward collectives (n_r·M more; a per-stage recompute mix:
                   its full blocks' count instead of n_r)
                   vocab-parallel embedding: all-reduce X in forward (first stage), head: all-reduce X
                   in backward (last stage), M calls each
    CP   (cp > 1)  ring: P2P of KV, (n-1) per block forward and 2(n-1) backward (K,V then dK,dV)
                   allgather: all-gather n·KV forward, reduce-scatter n·KV backward, per block
                   ulysses: all-to-all of n·X/tp twice (Q, O) and of n·KV once (K and V), forward
                   and again backward, per block; full recompute repeats the forward ones
    DP   (dp·cp > 1, over the dp_cp group, message P_r·d; gradients in the software's reduce dtype:
                   fp32 under autopar run, cost/framework.grad_reduce_bytes)
                   ZeRO-0 all-reduce of gradients, once per step (in buckets, overlapped)
                   ZeRO-1 reduce-scatter of gradients + all-gather of updated parameters, once each
                          per step, whatever M (gradients accumulate unsharded)
                   ZeRO-2 reduce-scatter of gradients (M) + all-gather of parameters (M): every
                          micro-batch (parameters are freed after each backward); at pp > 1 it
                          runs as ZeRO-1 (autopar.cost.zero.executed_zero)
                   ZeRO-3 all-gather forward (M) and backward (M) + reduce-scatter (M)
    PP   (pp > 1)  P2P of X/tp under SP (else X) per micro-batch per boundary: a rank sends the
                   activation out of each of its chunks but the last, and the gradient out of each
                   but the first (with pipeline scatter-gather: X/tp per rail + a tp all-gather of X);
                   beside X, the carried values C (``ModelGraph.carried_bytes``: an encoder's
                   output, CLIP's first tower), whole, with every send

Bytes a rank sends per call (nccl-tests bus convention, as ``cost.comm``):
all-reduce 2(n-1)/n·m, all-gather / reduce-scatter / all-to-all (n-1)/n·m, P2P m.
``time_s_per_call`` is ``cost.comm.collective_time_s`` on the axis's link: the time the collective
would take alone; the step model hides parts of it behind compute (see ``cost.stage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.cost.chain import build_chain_terms, evaluate_chain
from autopar.cost.comm import axis_link, collective_time_s
from autopar.cost.estimate import config_from_plan
from autopar.cost.framework import grad_reduce_bytes
from autopar.cost.stage import StageTerms, build_terms
from autopar.cost.step import chunk_rank, evaluate
from autopar.graph.model_graph import ModelGraph
from autopar.graph.scaling import Shape
from autopar.layout import EXPERT_AXES, Layout
from autopar.plan import Plan


def wire_factor(collective: str, group_size: int) -> float:
    """Bytes one rank sends per byte of message (see the module docstring)."""
    n = group_size
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


@dataclass(frozen=True, kw_only=True)
class CommItem:
    """One kind of collective on one rank of a pipeline stage, over one step."""

    what: str  # what it carries, e.g. "TP forward (block)"
    collective: str  # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    axis: str  # tp | cp | dp_cp | pp
    link: str  # nvlink | network
    group_size: int
    calls_per_step: float
    message_bytes: float  # one call's full tensor
    time_s_per_call: float

    @property
    def sent_bytes_per_step(self) -> float:
        """Bytes this rank puts on the link per step."""
        return self.calls_per_step * self.message_bytes * wire_factor(self.collective, self.group_size)

    @property
    def time_s_per_step(self) -> float:
        """Time of all calls if nothing overlapped them."""
        return self.calls_per_step * self.time_s_per_call


@dataclass(frozen=True, kw_only=True)
class StageVolume:
    """Every collective one GPU of pipeline rank ``rank`` takes part in, per step."""

    rank: int
    items: tuple[CommItem, ...]

    @property
    def sent_bytes_per_step(self) -> float:
        return sum(i.sent_bytes_per_step for i in self.items)

    def by_axis(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i in self.items:
            out[i.axis] = out.get(i.axis, 0.0) + i.sent_bytes_per_step
        return out


def communication_volume(plan: Plan, graph: ModelGraph, cluster: Cluster,
                         terms: StageTerms | None = None) -> tuple[StageVolume, ...]:
    """Per pipeline rank, the collectives of one step (formulas in the module docstring)."""
    cfg = config_from_plan(plan)
    terms = terms or build_terms(graph, cluster, cfg)
    layout = Layout.of(cfg)
    links = {axis: axis_link(cluster, layout, axis) for axis in ("tp", "cp", "dp_cp", "pp")}
    expert = terms.expert  # expert parallelism: experts over the ep group, their gradients over edp
    chain = build_chain_terms(graph, cluster, cfg) if graph.chain else None  # priced unit by unit
    if chain is not None:
        expert = chain.expert
    if expert is not None:
        links.update((axis, axis_link(cluster, layout, axis)) for axis in EXPERT_AXES)
    s_ratio = (cfg.seq_len / cfg.cp) / graph.seq_len if graph.is_sequence_model else 1.0
    kv_ratio = cfg.seq_len / graph.seq_len if graph.is_sequence_model else 1.0
    shape = Shape(b=cfg.micro_batch, s_ratio=s_ratio, kv_ratio=kv_ratio, t=cfg.tp)  # TP messages: no SP division
    x = graph.block_input_bytes * cfg.micro_batch * s_ratio
    chunks = [end - start for start, end in plan.stage_ranges()]
    last = len(chunks) - 1
    m = cfg.num_microbatches
    reduce_bytes = grad_reduce_bytes(cfg, cluster)
    if chain is not None:  # parameters per pipeline rank: each unit's own
        ranks = evaluate_chain(chain, plan.stage_ranges(), 0.0, 1.0, cluster.peak_flops).ranks
    else:
        ranks = evaluate(terms, chunks, 0.0, 1.0, cluster.peak_flops,
                         recompute_blocks=plan.parallel.recompute_blocks).ranks
    out = []
    for r in range(cfg.pp):
        local = [c for c in range(len(chunks)) if chunk_rank(c, cfg.pp) == r]
        blocks = sum(chunks[c] for c in local)
        # Blocks whose forward runs again in backward (full recompute; a per-stage mix: its full count).
        rerun = blocks if cfg.recompute == "full" else 0
        if plan.parallel.recompute_blocks is not None:
            rerun = plan.parallel.recompute_blocks[r][2]
        params = ranks[r].params
        moe_blocks = blocks  # blocks holding experts: all of a block list, a chain's MoE units
        if chain is not None:
            moe_blocks = sum(sum(chain.expert_units[a:b]) for c, (a, b) in enumerate(plan.stage_ranges())
                             if chunk_rank(c, cfg.pp) == r)
        # recomputed blocks holding experts: a block list's rerun; a chain's recompute is one mode
        moe_rerun = rerun if chain is None else (moe_blocks if rerun else 0)
        items: list[CommItem] = []

        def add(what: str, kind: str, axis: str, calls: float, nbytes: float) -> None:
            link = links[axis]
            if calls > 0 and nbytes > 0 and link.size > 1:
                items.append(CommItem(what=what, collective=kind, axis=axis, link=link.link_name,
                                      group_size=link.size, calls_per_step=calls, message_bytes=nbytes,
                                      time_s_per_call=collective_time_s(kind, nbytes, link)))

        _tp_items(add, graph, cfg, shape, blocks * m, x, terms, 0 in local, last in local, m, rerun * m)
        _cp_items(add, graph, cfg, blocks * m, x, rerun * m)
        if expert is not None:  # expert parallelism: dense parameters over dp x cp, experts over edp, tokens over ep
            params -= moe_blocks * (expert.block_params - expert.dense_params)
            _dp_items(add, cfg, moe_blocks * expert.expert_params, m, reduce_bytes, axis="edp", label="experts: ")
            a2a_calls = (moe_blocks + moe_rerun) * m * 2
            add("EP dispatch + combine (forward" + (", and again in recompute)" if rerun else ")"),
                "all_to_all", "ep", a2a_calls, expert.a2a_bytes)
            add("EP dispatch + combine (backward)", "all_to_all", "ep", moe_blocks * m * 2, expert.a2a_bytes)
        _dp_items(add, cfg, params, m, reduce_bytes)
        if cfg.pp > 1:
            sends = m * (sum(c < last for c in local) + sum(c > 0 for c in local))
            if cluster.pipeline_scatter_gather and not cfg.sequence_parallel and cfg.tp > 1:
                add("PP activations/gradients (1/tp per rail)", "p2p", "pp", sends, x / cfg.tp)
                add("PP re-gather after receive", "all_gather", "tp", sends, x)
            else:
                sp = cfg.tp if cfg.sequence_parallel and cfg.tp > 1 else 1
                add("PP activations/gradients", "p2p", "pp", sends, x / sp)
            # prologue outputs handed on beside the hidden state (ModelGraph.carried), whole
            add("PP carried values/gradients", "p2p", "pp", sends, terms.carried_bytes)
        out.append(StageVolume(rank=r, items=tuple(items)))
    return tuple(out)


def _tp_items(add, graph: ModelGraph, cfg, shape: Shape, block_calls: float, x: float,  # noqa: ANN001
              terms: StageTerms, first: bool, last: bool, m: int, rerun_calls: float) -> None:
    if cfg.tp == 1:
        return
    for phase, label in (("fwd", "forward"), ("bwd", "backward")):
        msgs = [q.nbytes * shape.scale(q.exps) for q in graph.regions["block"].comm if q.phase == phase]
        if not msgs:
            continue
        avg, per_block = sum(msgs) / len(msgs), len(msgs)
        reps = [(f"TP {label} (blocks)", block_calls * per_block)]
        if phase == "fwd" and rerun_calls:
            reps.append(("TP forward again (full recompute)", rerun_calls * per_block))
        for what, calls in reps:
            if cfg.sequence_parallel:
                add(what, "all_gather", "tp", calls, avg)
                add(what, "reduce_scatter", "tp", calls, avg)
            else:
                add(what, "all_reduce", "tp", calls, avg)
    # Vocab-parallel embedding / head: the cost model charges them exactly when tp_comm_s > 0.
    if first and terms.pre.tp_comm_s > 0:
        add("TP vocab-parallel embedding (forward)", "all_reduce", "tp", m, x)
    if last and terms.post.tp_comm_s > 0:
        add("TP vocab-parallel head (backward)", "all_reduce", "tp", m, x)


def _cp_items(add, graph: ModelGraph, cfg, block_calls: float, x: float, rerun_calls: float) -> None:  # noqa: ANN001
    if cfg.cp == 1:
        return
    n = cfg.cp
    heads, kv_heads = graph.num_heads, graph.num_kv_heads or graph.num_heads
    kv = 2 * x * ((kv_heads / heads) if heads else 1.0) / cfg.tp
    fwd_calls = block_calls + rerun_calls  # a fully recomputed block runs its forward twice
    dkv = kv * 4 / cfg.dtype_bytes  # the gradients travel in fp32 (executor/parallel/ring_attention.py)
    if cfg.cp_kind == "ring":
        add("CP ring K,V (forward)", "p2p", "cp", fwd_calls * (n - 1), kv)
        # backward passes the blocks round again, each with its gradient, which ends at its owner
        add("CP ring K,V (backward)", "p2p", "cp", block_calls * (n - 1), kv)
        add("CP ring dK,dV (backward)", "p2p", "cp", block_calls * n, dkv)
    elif cfg.cp_kind == "allgather":
        add("CP all-gather K,V (forward)", "all_gather", "cp", fwd_calls, kv * n)
        add("CP reduce-scatter dK,dV (backward)", "reduce_scatter", "cp", block_calls, dkv * n)
    else:
        q = x / cfg.tp
        # one all-to-all per tensor, of this rank's local tensor (as the cost model, stage._cp_time)
        add("CP Ulysses Q,O all-to-all (forward)", "all_to_all", "cp", fwd_calls * 2, q)
        add("CP Ulysses K,V all-to-all (forward)", "all_to_all", "cp", fwd_calls * 2, kv / 2)
        add("CP Ulysses Q,O all-to-all (backward)", "all_to_all", "cp", block_calls * 2, q)
        add("CP Ulysses K,V all-to-all (backward)", "all_to_all", "cp", block_calls * 2, kv / 2)


def _dp_items(add, cfg, params: float, m: int, reduce_bytes: float, axis: str = "dp_cp",  # noqa: ANN001
              label: str = "") -> None:
    """The data-parallel collectives of ``params`` parameters: gradients in the software's reduce
    dtype (cost/framework.grad_reduce_bytes), parameters in the training dtype."""
    grads, weights = params * reduce_bytes, params * cfg.dtype_bytes
    if cfg.zero == 0:
        add(label + "DP gradient all-reduce (bucketed)", "all_reduce", axis, 1, grads)
    elif cfg.zero == 1:
        add(label + "ZeRO-1 gradient reduce-scatter", "reduce_scatter", axis, 1, grads)
        add(label + "ZeRO-1 parameter all-gather", "all_gather", axis, 1, weights)
    elif cfg.zero == 2:
        add(label + "ZeRO-2 gradient reduce-scatter (every micro-batch)", "reduce_scatter", axis, m, grads)
        add(label + "ZeRO-2 parameter all-gather (every micro-batch)", "all_gather", axis, m, weights)
    else:
        add(label + "ZeRO-3 parameter all-gather (forward)", "all_gather", axis, m, weights)
        add(label + "ZeRO-3 parameter all-gather (backward)", "all_gather", axis, m, weights)
        add(label + "ZeRO-3 gradient reduce-scatter", "reduce_scatter", axis, m, grads)
