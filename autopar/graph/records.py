"""What a trace records, as plain data: ops, saved tensors and collectives of one forward+backward.

Kept apart from the recorder (``graph/trace.py``, which needs torch) so that the planner half --
fitted regions, the ModelGraph, the cost model and the search -- loads without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class OpRecord:
    """One aten op: which phase and region ran it, its FLOPs and the bytes it read and wrote."""

    name: str
    phase: str  # "fwd" | "bwd"
    region: str
    kind: str  # "gemm" | "attn" | "mem"
    flops: float
    bytes: float
    # (batch, m, n, k) of a GEMM; (batch x heads, query length, key length, head dim) of fused attention
    dims: tuple[int, int, int, int] | None = None
    # Bytes of the tensors it returns: what per-op selective recompute keeps of an op whose output
    # it saves (cost/compute.py ``op_saved``).
    out_bytes: float = 0.0
    # A fused attention kernel called with ``is_causal``: it skips the masked tiles, so it runs at
    # its causal rate (autopar.kernel_tables); torch's FLOP count is the full s^2 either way.
    causal: bool = False
    # Its dataflow, for finding a loop's fused scan (graph/fused_scan.py); kept only while fitting:
    # each tensor input and output as (id of the tensor it views, bytes it reads or writes, bytes of
    # that whole tensor), the elements it writes and those of its largest input.
    ins: tuple[tuple[int, float, float], ...] = ()
    outs: tuple[tuple[int, float, float], ...] = ()
    out_numel: float = 0.0
    in_numel: float = 0.0  # elements of its largest input


@dataclass(frozen=True, kw_only=True)
class SavedRecord:
    """One tensor kept for backward (an activation), attributed to the region that saved it.
    ``gemm_input``: it is the activation operand of a GEMM (a Linear's input), which DTensor's
    sequence parallelism saves as the all-gathered, full-sequence tensor (cost/compute.py)."""

    region: str
    nbytes: float
    gemm_input: bool = False
    root: int = 0  # id of the tensor it views (OpRecord.ins): which op produced it
    # Bytes CUDA's autocast over fp32 parameters keeps for it per byte traced (graph/cuda_autocast.py)
    autocast_factor: float = 1.0
    # the additive bias a self-attention kernel took for a boolean mask (graph/trace.py ``_flash_sdpa``):
    # queries x keys, quadratic in the sequence (graph/scaling.py ``_fit_saved`` where it is unpaired)
    attention_bias: bool = False


@dataclass(frozen=True, kw_only=True)
class PeakRecord:
    """The most bytes of temporaries (live tensors never saved for backward) in one phase of one
    region (``graph/live.py``): T, and in backward T''s and Tg''s parts at their peaks -- temporaries,
    the region's parameter gradients made so far (what an FSDP2 unit holds until its post-backward)
    and the saved activations backward has freed in the region by then (the credit)."""

    region: str
    phase: str  # "fwd" | "bwd"
    nbytes: float
    grads_temps_nbytes: float = 0.0
    grads_nbytes: float = 0.0
    # backward: T' (temporaries less the saved activations freed so far, at its peak) and Tg''s credit
    credit_temps_nbytes: float = 0.0
    credit_nbytes: float = 0.0
    grads_credit_nbytes: float = 0.0
    # backward: Tg''s (temporaries, gradients, credit) after each op, in order (graph/live.py's
    # backward_states): the other ops that peak at other shapes
    grads_states: tuple[tuple[float, float, float], ...] = ()
    # forward: the rise above the region's whole saved set at its forward's peak (graph/live.py's R):
    # its temporaries there and the saved bytes the forward makes after that op
    rise_temps_nbytes: float = 0.0
    rise_to_come_nbytes: float = 0.0


@dataclass(kw_only=True)
class Trace:
    """Everything recorded for one forward+backward."""

    ops: list[OpRecord] = field(default_factory=list)
    saved: list[SavedRecord] = field(default_factory=list)
    comm: list[tuple[str, str, str, float]] = field(default_factory=list)  # (region, phase, what, bytes)
    peaks: list[PeakRecord] = field(default_factory=list)  # one per (region, phase) the step ran

    def total(self, attr: str, phase: str | None = None, region: str | None = None) -> float:
        return sum(
            getattr(op, attr)
            for op in self.ops
            if (phase is None or op.phase == phase) and (region is None or op.region == region)
        )

    def saved_bytes(self, region: str | None = None) -> float:
        return sum(r.nbytes for r in self.saved if region is None or r.region == region)
