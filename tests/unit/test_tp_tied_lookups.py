"""Vocabulary-parallel edges when the token table is read by more than one module (BART: ``shared``,
the encoder's and the decoder's ``embed_tokens`` and the head are one Parameter) and a vocabulary
buffer is added to the logits after the head (``final_logits_bias``): every lookup runs vocab-parallel
on the one sharded parameter, and the buffer meets the sharded logits as a DTensor."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from autopar.executor.parallel.tensor_parallel import shard_vocab_edges


class _Seq2Seq(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, width)
        self.enc_embed = nn.Embedding(vocab, width)
        self.dec_embed = nn.Embedding(vocab, width)
        self.enc_embed.weight = self.dec_embed.weight = self.shared.weight
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.shared.weight
        self.register_buffer("final_logits_bias", torch.randn(1, vocab))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.enc_embed(src).mean(1, keepdim=True)
        return self.head(self.dec_embed(tgt) + memory) + self.final_logits_bias


def test_tied_lookups_and_a_vocab_buffer_run_vocab_parallel() -> None:
    torch.manual_seed(0)
    ref = _Seq2Seq()
    model = _Seq2Seq()
    model.load_state_dict(ref.state_dict())
    src, tgt = torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))
    expected = nn.functional.cross_entropy(ref(src, tgt).flatten(0, 1), tgt.flatten())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        spec = SimpleNamespace(vocab_embedding="shared", vocab_head="head")
        assert shard_vocab_edges(model, spec, mesh) == []
        assert model.enc_embed.weight is model.shared.weight is model.head.weight
        assert isinstance(model.final_logits_bias, DTensor)
        with loss_parallel():
            logits = model(src, tgt)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        assert torch.allclose(loss.full_tensor(), expected)
    finally:
        dist.destroy_process_group()
