"""A model whose forward loops over the sequence in Python is measured at a shorter sequence.

Measuring a model runs its forward on meta several times at its SEQ_LEN (the spec's probes, then the
traces at micro-batch 1 and 2 and half the sequence). On meta an aten op costs tens of microseconds
of Python dispatch whatever its size, so a forward whose op count grows with the sequence -- a
reference kernel that loops over every position, such as Hugging Face Jamba's selective scan on CPU
(4,096 steps in every Mamba layer) -- cannot be measured at full length within the time limit,
while its costs follow from shorter probes: the graph fits every quantity as a power law in the
sequence anyway (graph/scaling.py).

So the measurement runs with an op budget (``OPS_PER_FORWARD`` aten ops per forward; the zoo's
largest forward dispatches a few thousand). Within it nothing changes: the graph is measured at
SEQ_LEN as before. A forward past it stops at once (``spec.meta.op_budget``), and the model is
measured again as if its file declared ``SEQ_LEN = S / 2^k`` (the largest such length at most
``PROBE_SEQ``): its example inputs cut along the sequence (``graph.build.slice_sequence``, the cut
the half-sequence trace makes), traced there and at half that, and the fitted graph evaluated at S
(``scaling.at_longer_sequence``; exact for every quantity that is a monomial in the sequence, and
per-position loop ops scaled by the positions they stand for). The graph says so:
``ModelGraph.probe_seq_len`` is the sequence it was traced at, and ``autopar plan`` prints it.
What the extrapolation cannot see: a cost whose form changes between the probe and S (a sliding
window or a chunk length between the two); it is used only for models that could not be measured
at S at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from autopar.errors import ModelFileError
from autopar.graph.build import slice_sequence
from autopar.graph.model_graph import ModelGraph
from autopar.graph.scaling import at_longer_sequence
from autopar.modelfile import ModelFile
from autopar.spec.meta import OpBudgetExceeded, op_budget

# aten ops one forward on meta may dispatch before the sequence is shortened: the spec's own limit
# (spec/spec_inputs.py). A measurement traces forward and backward a few times, at about 0.5 ms an op
# on meta: RecurrentGemma-2B's small chain (two RG-LRU layers looping over 4,096 positions, ~41,000
# ops a forward) took 75 s to measure at full length under 50,000, 35 s shortened (the plan's goal: 60 s).
OPS_PER_FORWARD = 20_000
PROBE_SEQ = 256  # the longest sequence a shortened measurement traces at


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShortenedModelFile(ModelFile):
    """``ModelFile`` as if it declared ``SEQ_LEN = seq_len``: its example inputs, made at the file's
    own ``full_seq_len``, cut to ``seq_len`` along the sequence."""

    full_seq_len: int

    def example_inputs(self, micro_batch_size: int, device: Any = "meta") -> Any:
        return slice_sequence(super().example_inputs(micro_batch_size, device), self.full_seq_len, self.seq_len)


def probe_seq(seq_len: int) -> int | None:
    """The sequence a shortened measurement traces at: seq_len / 2^k, the largest that is at most
    PROBE_SEQ and even (the half-sequence trace halves it); None when there is none."""
    s = seq_len
    while s > PROBE_SEQ and s % 2 == 0:
        s //= 2
    return s if s <= PROBE_SEQ and s % 2 == 0 and s < seq_len else None


def build_bounded(mf: ModelFile, seq_len: int | None, dtype: str,
                  build: Callable[[ModelFile, int | None, str], ModelGraph]) -> ModelGraph:
    """``build(mf, seq_len, dtype)`` under the op budget; past it, the graph measured at a shorter
    sequence and evaluated at the full one (module docstring)."""
    full = seq_len or mf.seq_len
    if full is None or mf.seq_len is None or probe_seq(full) is None:
        return build(mf, seq_len, dtype)
    with op_budget(OPS_PER_FORWARD) as budget:
        try:
            graph = build(mf, seq_len, dtype)
        except (ModelFileError, OpBudgetExceeded):
            if not budget.tripped:
                raise
    if not budget.tripped:
        return graph
    s0 = probe_seq(full)
    assert s0 is not None
    short = ShortenedModelFile(**{f.name: getattr(mf, f.name) for f in dataclasses.fields(ModelFile)}
                               | {"seq_len": s0, "sha256": f"{mf.sha256}:seq{s0}", "full_seq_len": mf.seq_len})
    try:
        graph = build(short, None, dtype)
    except ModelFileError as exc:
        cause = str(exc).removeprefix(f"{mf.path}: ")
        raise ModelFileError(f"{mf.path}: a forward on meta at sequence {full} dispatches more than {OPS_PER_FORWARD} "
                             f"ops (a loop over positions?), and measuring it at sequence {s0} failed: {cause}") from None
    return at_sequence(graph, full, mf)


def at_sequence(graph: ModelGraph, seq_len: int, mf: ModelFile) -> ModelGraph:
    """``graph`` (measured at the shorter ``graph.seq_len``) evaluated at ``seq_len``, as the graph
    of ``mf``. A block's input (one sample's hidden states) is taken as linear in the sequence, as
    the cost model takes it at every other sequence (cost/stage.py, cost/chain.py)."""
    ratio = seq_len / graph.seq_len
    regions = {name: at_longer_sequence(fit, ratio) for name, fit in graph.regions.items()}
    chain = tuple(dataclasses.replace(u, input_bytes=u.input_bytes * ratio) for u in graph.chain)
    carried = tuple(dataclasses.replace(q, nbytes=q.nbytes * ratio ** q.exps.s) for q in graph.carried)
    out = graph.output
    output = None if out is None else dataclasses.replace(out, nbytes=out.nbytes * ratio ** out.exps.s)
    return dataclasses.replace(graph, sha256=mf.sha256, seq_len=seq_len, probe_seq_len=graph.seq_len,
                               regions=regions, chain=chain, block_input_bytes=graph.block_input_bytes * ratio,
                               batch_input_bytes=graph.batch_input_bytes * ratio,
                               carried=carried, output=output)
