"""A loop over positions is priced on a GPU as the fused scan kernel a GPU runs in its place
(graph/fused_scan.py, cost/fused_scan.py; Gu & Dao 2023, Section 3.3.2): its inputs read once, its
output written once, the backward re-reading the inputs -- not the per-position reference loop,
whose backward builds a sequence-long gradient at every position. A CPU profile keeps the loop's
own ops (the CPU really runs it); a model without a loop is priced as before."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autopar.cluster import load_cluster
from autopar.cost.compute import is_parameter_sized, op_time_s, region_time
from autopar.cost.fused_scan import runs_fused_scan, scan_saved_bytes, scan_times_s, vector_flops_per_s
from autopar.graph.measure import build_graph
from autopar.graph.scaling import Shape

D, N, H, SEQ = 32, 8, 16, 16  # scan width, state size, model width, sequence

MODEL = '''
import torch
from torch import nn
import torch.nn.functional as F

SEQ_LEN = {seq}


class GatedScan(nn.Module):
    """An element-wise gated linear recurrence with a state dimension, written as a reference loop:
    a (batch, seq, {d}, {n}) decay and input are made for every position, then a Python loop updates
    a ({d} x {n}) state per position and reads it out."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear({h}, {d})
        self.delta = nn.Linear({h}, {d})
        self.b = nn.Linear({h}, {n}, bias=False)
        self.c = nn.Linear({h}, {n}, bias=False)
        self.a_log = nn.Parameter(torch.zeros({d}, {n}))
        self.out = nn.Linear({d}, {h})

    def forward(self, x):
        u, dt = self.inp(x), F.softplus(self.delta(x))
        b, c = self.b(x), self.c(x)
        decay = torch.exp(-torch.exp(self.a_log) * dt[..., None])
        drive = dt[..., None] * b[:, :, None, :] * u[..., None]
        h = x.new_zeros(x.shape[0], {d}, {n})
{body}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, {h})
        self.layers = nn.ModuleList([GatedScan() for _ in range(2)])
        self.head = nn.Linear({h}, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randint(0, 64, (micro_batch_size, SEQ_LEN))
'''

LOOP = """\
        ys = []
        for t in range(x.shape[1]):
            h = decay[:, t] * h + drive[:, t]
            ys.append(torch.matmul(h, c[:, t, :, None])[..., 0])
        return x + self.out(torch.stack(ys, dim=1))"""
NO_LOOP = """\
        return x + self.out(((decay * h[:, None] + drive) * c[:, :, None, :]).sum(-1))"""


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The model with its loop, and the same file with one vectorised step instead (no loop over
    positions: the op count does not grow with the sequence)."""
    out = {}
    for name, body in (("scan", LOOP), ("fixed", NO_LOOP)):
        path = tmp_path_factory.mktemp(name) / f"{name}.py"
        path.write_text(MODEL.format(seq=SEQ, d=D, n=N, h=H, body=body), encoding="utf-8")
        out[name] = build_graph(path)
    return out


@pytest.fixture(scope="module")
def cpu():
    return load_cluster("cpu-local-2")


def _shape(b: float = 1.0, s: float = 1.0) -> Shape:
    return Shape(b=b, s_ratio=s, kv_ratio=s, t=1.0)


@pytest.mark.parametrize("b,s", [(1, 1.0), (4, 1.0), (2, 0.5)])
def test_gpu_reads_and_writes_what_the_fused_kernel_does(graphs, b, s) -> None:
    """Bytes at any shape = the kernel's inputs once (u and delta's pre-activation: b s D; B and C:
    b s N; A's parameter: D N) + its output once (y: b s D), all bf16 -- by hand."""
    scan = graphs["scan"].regions["block"].scan
    assert scan is not None
    sh, tokens = _shape(b, s), b * s * SEQ
    reads = sum(q.nbytes * sh.scale(q.exps) for q in scan.reads)
    writes = sum(q.nbytes * sh.scale(q.exps) for q in scan.writes)
    assert reads == pytest.approx(2 * (2 * tokens * D + 2 * tokens * N + D * N))
    assert writes == pytest.approx(2 * tokens * D)


def test_gpu_time_is_the_fused_kernel_plus_the_other_ops(graphs, a100) -> None:
    fit, sh = graphs["scan"].regions["block"], _shape(4)
    assert runs_fused_scan(a100)
    fwd_scan, bwd_scan = scan_times_s(fit, a100, sh)
    others = {"fwd": 0.0, "bwd": 0.0}
    for op in fit.ops:
        if not op.in_scan:
            others[op.phase] += op_time_s(op, sh, a100, SEQ, is_parameter_sized(op, True))[0]
    rt = region_time(fit, a100, sh, seq_len=SEQ)
    assert rt.fwd_s == pytest.approx(fwd_scan + others["fwd"])
    assert rt.bwd_s == pytest.approx(bwd_scan + others["bwd"])
    # the loop's per-position ops (and its (b, s, D, N) prologue and their backward) are what it replaces
    loop = [op for op in fit.ops if op.in_scan]
    assert sum(op.phase == "fwd" for op in loop) >= 3 * SEQ and sum(op.phase == "bwd" for op in loop) >= 3 * SEQ
    reads = sum(q.nbytes * sh.scale(q.exps) for q in fit.scan.reads)
    writes = sum(q.nbytes * sh.scale(q.exps) for q in fit.scan.writes)
    bw = a100.memory_bandwidth_bytes_per_s * a100.memory_efficiency
    vector = vector_flops_per_s(a100)
    compute = fit.scan.flops * sh.scale(fit.scan.flops_exps) / vector
    # the read-out (h @ c per position) is a matrix-vector product: the vector rate, not the tensor cores'
    gemms = [op for op in fit.ops if op.in_scan and op.phase == "fwd" and op.kind == "gemm"]
    assert len(gemms) == SEQ and all(op.dims[2] == 1 for op in gemms)
    compute += sum(op.flops * sh.scale(op.flops_exps) for op in gemms) / vector
    assert fwd_scan == pytest.approx(max((reads + writes) / bw, compute) + a100.kernel_overhead_s)
    assert bwd_scan == pytest.approx(max((2 * reads + writes) / bw, 2 * compute) + a100.kernel_overhead_s)
    # FLOPs still count (the MFU numerator is the model's, whatever kernel runs it)
    plain = region_time(fit, load_cluster("cpu-local-2"), sh, seq_len=SEQ)
    assert (rt.fwd_flops, rt.bwd_flops) == pytest.approx((plain.fwd_flops, plain.bwd_flops))


def test_gpu_saves_the_inputs_not_the_states(graphs, a100, cpu) -> None:
    fit, sh = graphs["scan"].regions["block"], _shape(2)
    gpu = region_time(fit, a100, sh, seq_len=SEQ).saved_bytes
    eager = region_time(fit, cpu, sh, seq_len=SEQ).saved_bytes
    kept = sum(q.nbytes * sh.scale(q.exps) for q in fit.saved if not q.in_scan)
    assert gpu == pytest.approx(kept + scan_saved_bytes(fit.scan, sh))
    # the reference loop keeps a (b, s, D, N) decay and input and a state per position: far more
    assert eager > gpu + 2 * 2 * SEQ * D * N * 2


def test_cpu_profile_prices_the_loop_as_traced(graphs, cpu) -> None:
    fit, sh = graphs["scan"].regions["block"], _shape(2)
    assert not runs_fused_scan(cpu)
    assert region_time(fit, cpu, sh, seq_len=SEQ) == region_time(replace(fit, scan=None), cpu, sh, seq_len=SEQ)
    rt = region_time(fit, cpu, sh, seq_len=SEQ)
    eager_bwd = sum(op_time_s(op, sh, cpu, SEQ, is_parameter_sized(op, True))[0] for op in fit.ops if op.phase == "bwd")
    assert rt.bwd_s == pytest.approx(eager_bwd)


def test_the_profile_s_software_key_overrides_the_device(graphs, a100, cpu) -> None:
    """``software.fused_scan: false`` (a GPU whose software lacks the kernel) prices the loop as
    traced; ``true`` on a CPU-measured profile prices the kernel; unset, the device decides."""
    fit, sh = graphs["scan"].regions["block"], _shape(2)
    no_kernel = replace(a100, fused_scan=False)
    assert runs_fused_scan(a100) and not runs_fused_scan(no_kernel)
    traced = region_time(replace(fit, scan=None), no_kernel, sh, seq_len=SEQ)
    assert region_time(fit, no_kernel, sh, seq_len=SEQ) == traced
    assert region_time(fit, a100, sh, seq_len=SEQ).bwd_s < traced.bwd_s
    assert runs_fused_scan(replace(cpu, fused_scan=True))


def test_the_software_key_is_read_from_a_profile(tmp_path) -> None:
    from autopar.errors import ClusterError

    src = (Path(__file__).resolve().parents[2] / "profiles" / "a100-80g.yaml").read_text()
    assert "\nsoftware:" in src
    for value, expected in (("false", False), ("true", True), ("maybe", None)):
        path = tmp_path / f"a100-{value}.yaml"
        path.write_text(src.replace("\nsoftware:", f"\nsoftware:\n  fused_scan: {value}", 1))
        if expected is None:
            with pytest.raises(ClusterError, match="fused_scan"):
                load_cluster(str(path))
        else:
            assert load_cluster(str(path)).fused_scan is expected


def test_a_model_without_a_loop_over_positions_is_untouched(graphs, a100) -> None:
    g = graphs["fixed"]
    assert all(f.scan is None for f in g.regions.values())
    assert not any(op.in_scan or op.per_position for f in g.regions.values() for op in f.ops)
    assert not any(q.in_scan for f in g.regions.values() for q in f.saved)
    fit, sh = g.regions["block"], _shape(4)
    rt = region_time(fit, a100, sh, seq_len=SEQ)
    assert rt.fwd_s == pytest.approx(sum(op_time_s(op, sh, a100, SEQ, is_parameter_sized(op, True))[0]
                                         for op in fit.ops if op.phase == "fwd"))


CHUNKS = 4  # positions per step of a chunked loop
CHUNK_LOOP = f"""\
        ys = []
        for t0 in range(0, x.shape[1], {CHUNKS}):  # a chunked algorithm: one step per {CHUNKS} positions
            h = decay[:, t0:t0 + {CHUNKS}].prod(1) * h + drive[:, t0:t0 + {CHUNKS}].sum(1)
            ys.append(torch.matmul(c[:, t0:t0 + {CHUNKS}], h.transpose(1, 2)))
        return x + self.out(torch.cat(ys, dim=1))"""


def test_a_loop_over_chunks_is_priced_as_it_runs(tmp_path) -> None:
    # HF MiniMax's lightning attention steps through 16 blocks of 256 positions, each a few matrix
    # products: the algorithm a GPU runs as written. Priced as a fused scan it saved nothing, and its
    # top plan at 64 H100s rehearsed 14.6 % over its price (85.8 GiB, priced 73.5: it did not fit)
    path = tmp_path / "chunks.py"
    path.write_text(MODEL.format(seq=SEQ, d=D, n=N, h=H, body=CHUNK_LOOP), encoding="utf-8")
    g = build_graph(path)
    assert all(f.scan is None for f in g.regions.values())
    assert not any(op.in_scan for f in g.regions.values() for op in f.ops)


def test_a_loop_over_positions_is_still_a_scan(graphs) -> None:
    assert graphs["scan"].regions["block"].scan is not None
