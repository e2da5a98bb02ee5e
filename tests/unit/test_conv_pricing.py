"""Convolutions priced as the implicit GEMMs they run as (graph/trace.py ``_conv_gemms``,
cost/compute.py ``op_time_s``): never faster than their FLOPs allow at that GEMM's rate (a grouped,
depthwise one at the vector rate), and their backward's FLOPs counted per group -- torch's own count
ignores the groups of a grouped convolution's backward, which made a ConvNeXt's model FLOPs three
times too high and its planned MFU 87 %."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autopar.cluster import load_cluster
from autopar.cost.compute import op_time_s
from autopar.cost.fused_scan import vector_flops_per_s
from autopar.graph.measure import build_graph
from autopar.graph.scaling import Shape
from autopar.graph.trace import _conv_gemms

MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)   # depthwise: a few FLOPs per byte
        self.pw = nn.Conv2d(c, 4 * c, 1)                    # pointwise: a GEMM
        self.out = nn.Conv2d(4 * c, c, 3, padding=1)        # dense 3x3: compute-bound

    def forward(self, x):
        return x + self.out(torch.relu(self.pw(self.dw(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 4, stride=4)
        self.blocks = nn.ModuleList([Block(64) for _ in range(2)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randn(micro_batch_size, 3, 64, 64)


def loss_fn(out, inputs):
    return out.float().pow(2).mean()
'''


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple, float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in ("convolution", "convolution_backward"):
            torch_flops = float(flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out))
            dims, flops = _conv_gemms(name, args, out, torch_flops)
            self.seen.append((name, dims, flops, torch_flops))
        return out


@pytest.mark.parametrize("groups", [1, 32])
def test_the_implicit_gemms_of_a_convolution_and_its_backward(groups: int) -> None:
    conv = nn.Conv1d(32, 64, 4, padding=3, groups=groups)
    x = torch.randn(2, 32, 20, requires_grad=True)
    rec = _Record()
    with rec:
        conv(x).sum().backward()
    (_, fwd_dims, fwd_flops, torch_fwd), (_, bwd_dims, bwd_flops, torch_bwd) = rec.seen
    rows, cols, depth = 2 * 23, 64 // groups, 32 // groups * 4  # positions x samples, out / g, in / g x taps
    assert fwd_dims == (groups, rows, cols, depth) and fwd_flops == torch_fwd == 2 * groups * rows * cols * depth
    assert bwd_dims == (2 * groups, rows, cols, depth)  # the input's and the weight's gradient
    assert bwd_flops == 2 * fwd_flops
    if groups == 1:
        assert torch_bwd == bwd_flops
    else:
        assert torch_bwd > 5 * bwd_flops  # torch's count without the groups: what the planner no longer takes


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "convnet.py"
    path.write_text(MODEL, encoding="utf-8")
    return build_graph(path, dtype="bf16", memo=False)


def test_a_convolution_is_never_priced_faster_than_its_flops_allow(graph) -> None:
    cluster = load_cluster("a100-80g")
    shape = Shape(b=8, s_ratio=1.0, kv_ratio=1.0, t=1)
    convs = [op for fit in graph.regions.values() for op in fit.ops if op.name.startswith("convolution")]
    assert len(convs) == 2 * (1 + 3)  # the stem and the block's three (the graph holds one block), fwd and bwd
    for op in convs:
        assert op.dims is not None
        seconds, flops = op_time_s(op, shape, cluster)
        assert flops > 0
        batch, m, n, k = (d * shape.scale(e) for d, e in zip(op.dims, op.dims_exps))
        rate = max(cluster.gemm_flops_per_s(batch * m, n, k), vector_flops_per_s(cluster))
        assert seconds >= flops / rate
        assert seconds >= flops / cluster.peak_flops  # the roofline: never above the peak


def test_the_model_s_flops_fit_its_priced_time(graph) -> None:
    """Priced at 64 A100s, what the plan reports as MFU stays below the GEMM curve's best."""
    from autopar.cost.compute import graph_region_time

    cluster = load_cluster("a100-80g")
    shape = Shape(b=8, s_ratio=1.0, kv_ratio=1.0, t=1)
    seconds = flops = 0.0
    for region in graph.regions:
        rt = graph_region_time(graph, region, cluster, shape)
        seconds += rt.fwd_s + rt.bwd_s
        flops += sum(op_time_s(op, shape, cluster)[1] for op in graph.regions[region].ops)
    assert 0 < flops / seconds < 0.8 * cluster.peak_flops
