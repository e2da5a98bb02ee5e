"""A model whose forward loops over the sequence in Python (a reference scan) is measured at a shorter
sequence and its fitted graph evaluated at SEQ_LEN (graph/short_probe.py): fast where a trace at
SEQ_LEN would dispatch an op per position, and, where both are possible, equal to the direct trace
in every quantity the fit is exact for. The op budget and the probe length are shrunk here so that
the test runs in seconds; the mechanism is the one HF Jamba's full size plans with."""

from __future__ import annotations

import time

import pytest

import autopar.graph.short_probe as short_probe
from autopar.graph.measure import build_graph
from autopar.graph.model_graph import region_totals
from autopar.graph.scaling import Shape

MODEL = '''
import torch
from torch import nn

SEQ_LEN = {seq}


class Scan(nn.Module):
    """A linear recurrence run the way a reference kernel runs it: one step per position."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 16)
        self.decay = nn.Parameter(torch.full((32,), 0.9))

    def forward(self, x):
        h = self.inp(x)
        state = torch.zeros_like(h[:, 0])
        states = []
        for i in range(h.shape[1]):
            state = state * self.decay + h[:, i]
            states.append(state)
        return x + self.out(torch.stack(states, dim=1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([Scan() for _ in range(3)])
        self.head = nn.Linear(16, 64)

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

BASE = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1)


def _model(tmp_path, seq: int):
    path = tmp_path / f"scan_{seq}.py"
    path.write_text(MODEL.format(seq=seq), encoding="utf-8")
    return path


@pytest.fixture
def small_budget(monkeypatch):
    # a forward of the scan dispatches ~3 ops per position and layer: past 600 ops from 64 positions on
    monkeypatch.setattr(short_probe, "OPS_PER_FORWARD", 600)
    monkeypatch.setattr(short_probe, "PROBE_SEQ", 32)


def test_a_per_position_loop_at_a_long_sequence_is_traced_short_and_quickly(tmp_path, small_budget):
    start = time.process_time()
    graph = build_graph(_model(tmp_path, 8192), dtype="fp32", memo=False)
    assert time.process_time() - start < 20  # at 8,192 positions a direct trace takes minutes
    assert graph.seq_len == 8192 and graph.probe_seq_len == 32 and graph.is_sequence_model
    # the loop's ops are counted once per position: its FLOPs grow with the sequence like the GEMMs'
    ops = graph.regions["block"].ops
    assert any(o.per_position for o in ops)


def test_extrapolated_costs_equal_a_direct_trace_where_the_fit_is_exact(tmp_path, small_budget, monkeypatch):
    path = _model(tmp_path, 256)
    short = build_graph(path, dtype="fp32", memo=False)
    assert short.probe_seq_len == 32  # 256 -> 32 and 16: an eightfold extrapolation
    monkeypatch.setattr(short_probe, "OPS_PER_FORWARD", 10**9)
    direct = build_graph(path, dtype="fp32", memo=False)
    assert direct.probe_seq_len is None and direct.seq_len == short.seq_len == 256
    assert short.num_params == direct.num_params and short.block_input_bytes == direct.block_input_bytes
    for name, fit in direct.regions.items():
        want, got = region_totals(fit, BASE), region_totals(short.regions[name], BASE)
        for key in ("fwd_flops", "bwd_flops", "saved_bytes"):  # monomials in the sequence: exact
            assert got[key] == pytest.approx(want[key], rel=1e-9), (name, key)
    # bytes moved: a quantity that is a constant plus a sequence term (a Linear's weights and its
    # activations, an embedding table and its rows) is fitted by one rounded exponent, and an eightfold
    # extrapolation shows it (the embedding's and the head's traffic come out at about half); the scan
    # block's total, its loop's steps included, stays within a few per cent
    block = sum(o.bytes for o in direct.regions["block"].ops)
    assert sum(o.bytes for o in short.regions["block"].ops) == pytest.approx(block, rel=0.05)
    # one fitted op per loop step stands for the positions beyond the probe's: the graph stays small
    assert len(short.regions["block"].ops) < len(direct.regions["block"].ops) / 4
    assert short.model_flops_per_sample() == pytest.approx(direct.model_flops_per_sample(), rel=1e-9)


def test_a_model_within_the_budget_is_traced_at_its_sequence(tmp_path, small_budget):
    graph = build_graph(_model(tmp_path, 16), dtype="fp32", memo=False)  # 16 positions: ~150 ops a forward
    assert graph.probe_seq_len is None and graph.seq_len == 16
