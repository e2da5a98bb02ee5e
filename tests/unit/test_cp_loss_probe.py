"""The context-parallel loss check probes a short prefix of one row, not the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.executor.parallel import context_parallel as cpm


def _next_token(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def test_probe_is_one_row_and_a_prefix(monkeypatch) -> None:
    shapes = []
    real = torch.randn

    def spy(*size, **kw):  # noqa: ANN002, ANN003, ANN202
        shapes.append(tuple(size))
        return real(*size, **kw)

    monkeypatch.setattr(cpm.torch, "randn", spy)
    tokens = torch.randint(0, 50, (16, 512))
    assert cpm.is_next_token_loss(_next_token, tokens, 50)
    assert shapes == [(1, cpm.PROBE_TOKENS, 50)]


def test_sequence_bound_loss_falls_back_to_the_whole_row() -> None:
    tokens = torch.randint(0, 50, (4, 128))

    def fixed_length(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        assert logits.shape[1] == 128  # a loss that only takes the model's sequence length
        return _next_token(logits, t)

    assert cpm.is_next_token_loss(fixed_length, tokens, 50)


def test_other_losses_are_refused() -> None:
    tokens = torch.randint(0, 50, (2, 128))

    def same_token(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # not shifted
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), t.reshape(-1))

    assert not cpm.is_next_token_loss(same_token, tokens, 50)
