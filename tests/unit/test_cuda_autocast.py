"""What CUDA's autocast keeps for backward (graph/cuda_autocast.py): the trace's shadow dtypes
against a real step under autocast over fp32 parameters, and the fp32 list a CPU rehearsal borrows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.graph.cuda_autocast import cuda_fp32_functions
from autopar.graph.trace import cuda_like_functions_everywhere, run_and_trace

# 14 tokens (2 x 7): every activation's size is a multiple of 7, no parameter's is, so a real step's
# saved tensors are told from autocast's weight copies by their size
BATCH, SEQ, HIDDEN, HEADS = 2, 7, 32, 4


class _Block(nn.Module):
    """A pre-norm decoder block in one of three styles: GPT (LayerNorm, fused qkv, explicit softmax
    and dropout, GELU), Llama (a Hugging Face RMSNorm, separate q/k/v, rotary, explicit softmax,
    SwiGLU), or GPT with SDPA."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        h = HIDDEN
        if style == "llama":
            self.n1, self.n2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
            self.q, self.k, self.v = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
            self.gate, self.up = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, 3 * h, bias=False)
            self.down = nn.Linear(3 * h, h, bias=False)
            self.register_buffer("cos", torch.ones(SEQ, h // HEADS))
        else:
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.fc1, self.fc2 = nn.Linear(h, 3 * h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.o = nn.Linear(h, h)

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # Hugging Face's LlamaRMSNorm: fp32 inside, back to the input's dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * x.to(dtype)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(BATCH, SEQ, HEADS, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "llama":
            h = self._rms(x, self.n1)
            q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
            cos = self.cos.to(x.dtype)
            q, k = q * cos, k * cos
        else:
            q, k, v = (self._heads(t) for t in self.qkv(self.ln1(x)).split(HIDDEN, -1))
        if self.style == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        else:
            probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)
            if self.style == "gpt":
                probs = F.dropout(probs, 0.1, self.training)
            y = torch.matmul(probs, v)
        x = x + self.o(y.transpose(1, 2).reshape(BATCH, SEQ, HIDDEN))
        if self.style == "llama":
            h = self._rms(x, self.n2)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _model(style: str, device: str, dtype: torch.dtype) -> tuple[nn.Embedding, _Block]:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Embedding(64, HIDDEN).to(dtype), _Block(style).to(dtype)


def _traced_autocast_bytes(style: str) -> tuple[float, float]:
    """(bytes saved in 16 bits, bytes CUDA's autocast would save) by the block, from the meta trace."""
    emb, block = _model(style, "meta", torch.bfloat16)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")

    def step(set_region):  # noqa: ANN001, ANN202
        set_region("pre")
        x = emb(ids)
        set_region("block")
        y = block(x)
        set_region("post")
        loss = y.float().pow(2).mean()
        set_region("bwd:post")
        loss.backward()

    trace = run_and_trace(step, list(emb.parameters()) + list(block.parameters()))
    rows = [r for r in trace.saved if r.region == "block"]
    return sum(r.nbytes for r in rows), sum(r.nbytes * r.autocast_factor for r in rows)


def _autocast_saved_bytes(style: str) -> float:
    """Bytes the block saves for backward in a real step under autocast over fp32 parameters, with
    CUDA's fp32 list and dropout mask (the rehearsal's functions), each storage once."""
    emb, block = _model(style, "cpu", torch.float32)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    storages: dict[int, int] = {}
    recording = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if recording[0] and t.numel() % SEQ == 0:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with cuda_like_functions_everywhere(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        x = emb(ids)
        recording[0] = True
        y = block(x)
        recording[0] = False
        y.float().pow(2).mean().backward()
    return float(sum(storages.values()))


@pytest.mark.parametrize("style", ["gpt", "llama", "sdpa"])
def test_the_traces_autocast_bytes_are_what_autocast_saves(style: str) -> None:
    traced, autocast = _traced_autocast_bytes(style)
    if style == "sdpa":  # the CPU has no flash kernel to run for real: the trace's rules, by hand
        assert autocast > traced  # the residual stream's norm inputs are fp32
        return
    real = _autocast_saved_bytes(style)
    assert autocast == pytest.approx(real, rel=0.005), (style, traced, autocast, real)
    assert autocast > 1.1 * traced  # fp32 probabilities, norm inputs; one 16-bit copy per projection


def test_explicit_probabilities_are_fp32_and_copied_for_their_matmul() -> None:
    emb, block = _model("gpt", "meta", torch.bfloat16)
    block.eval()  # no dropout: the softmax's fp32 output and bmm's 16-bit copy of it

    def step(set_region):  # noqa: ANN001, ANN202
        set_region("block")
        loss = block(emb(torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"))).float().sum()
        set_region("bwd:block")
        loss.backward()

    trace = run_and_trace(step, list(emb.parameters()) + list(block.parameters()))
    probs = BATCH * HEADS * SEQ * SEQ * 2
    factors = {r.autocast_factor for r in trace.saved if r.nbytes == probs}
    assert 3.0 in factors  # 4 bytes (softmax's output) + 2 (the matmul's copy) per traced 2


def test_a_cpu_autocast_borrows_cudas_fp32_list() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x, -1).dtype == torch.bfloat16  # CPU autocast's own list
        with cuda_fp32_functions():
            assert torch.softmax(x, -1).dtype == torch.float32
            assert x.softmax(-1).dtype == torch.float32
            assert F.layer_norm(x, (8,)).dtype == torch.float32
            assert x.pow(2).dtype == torch.float32 and torch.rsqrt(x.abs() + 1).dtype == torch.float32
            assert x.sum().dtype == torch.float32
            assert x.softmax(-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype opts out
            assert (x @ x.T).dtype == torch.bfloat16  # the lower-precision list is unchanged
    with cuda_fp32_functions():
        assert torch.softmax(x, -1).dtype == torch.bfloat16  # only under autocast


def _conv_net() -> nn.Module:
    # batch norm keeps its input's 16 bits (on no list); group norm is on CUDA's fp32 list, so the
    # ReLU after it and the next convolution's input (cast to a 16-bit copy) are fp32
    return nn.Sequential(nn.Conv2d(3, 14, 3), nn.BatchNorm2d(14), nn.ReLU(), nn.Conv2d(14, 14, 3),
                         nn.GroupNorm(2, 14), nn.ReLU(), nn.Conv2d(14, 14, 3))


def test_a_conv_nets_autocast_bytes_are_what_autocast_saves() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = _conv_net().to(torch.bfloat16)
    image = torch.zeros(2, 3, 14, 14, device="meta", dtype=torch.bfloat16)

    def step(set_region):  # noqa: ANN001, ANN202
        set_region("block")
        loss = meta(image).float().pow(2).mean()
        set_region("bwd:block")
        loss.backward()

    trace = run_and_trace(step, list(meta.parameters()))
    autocast = sum(r.nbytes * r.autocast_factor for r in trace.saved)

    net, storages = _conv_net(), {}
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # activations only: a parameter's 16-bit copy has a parameter's element count
        if t.untyped_storage().data_ptr() not in weights and t.numel() not in {p.numel() for p in net.parameters()}:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with cuda_like_functions_everywhere(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.zeros(2, 3, 14, 14)).float().pow(2).mean().backward()
    assert autocast == pytest.approx(sum(storages.values()), rel=0.02)
