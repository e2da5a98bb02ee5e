"""fp32 features into 16-bit weights (autopar.input_cast): a model that computes part of its forward in
fp32 on purpose (DiT's sinusoidal timestep features) trains under FSDP2's mixed precision, where its
parameters are bf16 and there is no autocast. The hook narrows only what is wider than the weight,
and the planner's trace sees the same bf16 activations the run keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.input_cast import cast_wider_inputs, gemm_like
from autopar.modelfile import load_model_file

ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


class _Timestep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 16))
        self.norm = nn.LayerNorm(16)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(4, dtype=torch.float32))
        args = t[:, None].float() * freqs[None]  # fp32 whatever the parameters are
        return self.norm(self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1)))


def test_without_the_cast_bf16_weights_refuse_fp32_features() -> None:
    net = _Timestep().to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        net(torch.arange(3))


def test_the_cast_narrows_fp32_features_and_trains() -> None:
    net = _Timestep().to(torch.bfloat16)
    assert cast_wider_inputs(net) == 2 and cast_wider_inputs(net) == 0  # hooked once
    out = net(torch.arange(3))
    assert out.dtype == torch.bfloat16
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in net.parameters())


def test_the_cast_never_widens() -> None:
    # under autocast the weights are fp32 and a bf16 input stays bf16 (autocast casts it); so does a
    # model trained in fp32
    lin = nn.Linear(4, 4)
    cast_wider_inputs(lin)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(torch.randn(2, 4, dtype=torch.bfloat16))
    lin(torch.randn(2, 4))
    assert seen == [torch.bfloat16, torch.float32]


def test_only_gemm_like_modules_are_hooked() -> None:
    assert gemm_like(nn.Linear(2, 2)) and gemm_like(nn.Conv2d(2, 2, 3)) and gemm_like(nn.ConvTranspose1d(2, 2, 3))
    assert not gemm_like(nn.LayerNorm(4)) and not gemm_like(nn.Embedding(4, 4)) and not gemm_like(nn.RMSNorm(4))


def test_a_built_model_file_is_hooked_and_its_graph_keeps_bf16_activations() -> None:
    from autopar.graph import build_graph

    mf = load_model_file(ZOO / "torch_dit.py")
    model = mf.build("cpu").to(torch.bfloat16)
    inputs = mf.example_inputs(2, "cpu")
    out = model(**{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()})
    assert out.dtype == torch.bfloat16  # the timestep features entered the bf16 MLP narrowed
    graph = build_graph(str(ZOO / "torch_dit.py"), dtype="bf16")
    # every activation the block saves per token-wide tensor is 16-bit: no fp32 copy of the stream
    hidden = 64 * (8 // 2) ** 2  # tiny DiT: width 64, 4 x 4 patches per image
    fp32_wide = [q for q in graph.regions["block"].saved if q.nbytes >= 4 * hidden and q.nbytes % (4 * hidden) == 0
                 and q.nbytes // (4 * hidden) in (1, 3, 4) and q.autocast_factor == 1.0 and q.exps.b == 1.0]
    assert not fp32_wide, fp32_wide
