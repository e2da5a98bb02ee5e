"""torch.distributed.pipelining's gather window: which local chunks hold gathered parameters.

The pipelining runtime (``_PipelineScheduleRuntime``, which ScheduleInterleaved1F1B runs on) lowers a
multi-chunk schedule with FSDP2 unshard and reshard actions of its own
(``_add_unshard_reshard(max_active_stages=3)``): before each action a rank unshards the next three
distinct local chunks it will run -- every FSDP2 unit of each, at once -- and reshards every other
chunk. With more local chunks than that (v > 3) the window moves through the step, and what a rank
holds follows it: ``window_chunks`` (ZeRO-1/2, which keep parameters gathered between
micro-batches: only the window's chunks hold them) and ``prefetched_chunks`` (ZeRO-3, which
reshards block by block: whole chunks wait gathered ahead of their turn). ``StageTerms.window``
prices both; the split programs (search/ilp.py, ilp_recompute.py) and the search's bounds read the
same rule.
"""

from __future__ import annotations

from typing import Any, Protocol

from autopar.layout import executed_zero


class _Layout(Protocol):
    """What the window reads of a configuration (cost.terms.Config, which imports this module)."""

    dp: int
    cp: int
    pp: int
    zero: int
    schedule: str
    virtual_stages: int
    offload: Any


# the runtime's max_active_stages (module docstring)
PIPELINE_GATHERED_CHUNKS = 3


def _windowed(*, zero: int, shard_degree: int, pp: int, schedule: str, virtual_stages: int) -> bool:
    """Whether the runtime's window moves in the steady state: FSDP2 shards (ZeRO >= 1 over more
    than one rank) and interleaved 1F1B has more local chunks than the window holds (with v <= 3
    every chunk stays in it once fetched)."""
    return (pp > 1 and shard_degree > 1 and zero >= 1 and schedule == "interleaved-1f1b"
            and virtual_stages > PIPELINE_GATHERED_CHUNKS)


def window_chunks(*, zero: int, shard_degree: int, pp: int, schedule: str, virtual_stages: int) -> int:
    """How many of a pipeline rank's local chunks hold their parameters gathered at once where the
    executor's FSDP2 keeps them gathered between micro-batches (ZeRO-1/2 under a pipeline), 0 where
    every chunk does. Under interleaved 1F1B with v > 3 the runtime reshards all but the next
    three chunks it will run, so a rank holds at most three chunks' 16-bit copies beside the whole
    stage's fp32 shards. Rehearsed (docs/results.md): Llama-3 70B at 1,024 H100s (ZeRO-1, v 6, 19
    blocks as 3-3-3-3-3-4) held 10 blocks' and the embedding's 16-bit parameters at its peak,
    the three largest chunks; GPT-3 175B (v 8) three one-block chunks' of its twelve blocks."""
    args = dict(zero=zero, shard_degree=shard_degree, pp=pp, schedule=schedule, virtual_stages=virtual_stages)
    return PIPELINE_GATHERED_CHUNKS if zero in (1, 2) and _windowed(**args) else 0


def prefetched_chunks(*, zero: int, shard_degree: int, pp: int, schedule: str, virtual_stages: int) -> int:
    """How many whole local chunks a ZeRO-3 rank holds gathered ahead of their turn: the runtime
    unshards each chunk entering its window whole, and the gathered copies wait until the chunk
    runs (FSDP2 then reshards block by block, as without a pipeline): the two chunks after the
    running one, where the window moves (v > 3); 0 elsewhere. Rehearsed on a 24-layer GPT at
    dp 2, pp 2, ZeRO-3: v 4 held six blocks' all-gather outputs beyond the running block's two
    (two 3-block chunks), v 2 none."""
    args = dict(zero=zero, shard_degree=shard_degree, pp=pp, schedule=schedule, virtual_stages=virtual_stages)
    return PIPELINE_GATHERED_CHUNKS - 1 if zero == 3 and _windowed(**args) else 0


def executor_window(cfg: _Layout) -> tuple[int, int]:
    """(``window_chunks``, ``prefetched_chunks``) of ``cfg`` as the executor runs it (FSDP2 under
    torch.distributed.pipelining); (0, 0) under host offload of the states (the offload model prices
    their device copies). A software with its own gradient buffer (``Cluster.main_grad_bytes``,
    Megatron-Core, whose distributed optimizer keeps every 16-bit parameter) has no window:
    ``StageTerms`` asks this only for the executor."""
    # (FSDP2's fully_shard with something to shard: ZeRO >= 1 over more than one rank, _windowed)
    if cfg.offload.states:
        return 0, 0
    args = dict(zero=executed_zero(cfg.zero, cfg.pp), shard_degree=cfg.dp * cfg.cp, pp=cfg.pp,
                schedule=cfg.schedule, virtual_stages=cfg.virtual_stages)
    return window_chunks(**args), prefetched_chunks(**args)
