"""An op with no meta kernel (the CTC loss: HF Wav2Vec2ForCTC's ``labels`` loss) answers its output
shapes on meta, forward and backward (spec/meta_fallback.py), so a model trained through it plans."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.spec.meta import tolerant_meta
from autopar.spec.meta_fallback import MAX_INPUT_BYTES, run_for_shapes

T, B, C, S = 20, 3, 6, 5


def test_ctc_loss_forward_and_backward_on_meta() -> None:
    logits = torch.empty(T, B, C, device="meta", requires_grad=True)
    targets = torch.empty(B, S, dtype=torch.long, device="meta")
    lengths_in = torch.full((B,), T, dtype=torch.long, device="meta")
    lengths_t = torch.full((B,), S, dtype=torch.long, device="meta")
    with tolerant_meta():
        loss = F.ctc_loss(logits.log_softmax(-1), targets, lengths_in, lengths_t, reduction="mean")
        assert loss.shape == () and loss.is_meta
        (grad,) = torch.autograd.grad(loss, logits)
    assert grad.shape == (T, B, C) and grad.is_meta


def test_the_alpha_table_is_as_wide_as_the_targets() -> None:
    op = torch.ops.aten._ctc_loss.Tensor
    args = (torch.empty(T, B, C, device="meta"), torch.empty(B, S, dtype=torch.long, device="meta"),
            torch.empty(B, dtype=torch.long, device="meta"), torch.empty(B, dtype=torch.long, device="meta"))
    nll, alpha = run_for_shapes(op, args, {})
    assert nll.shape == (B,) and alpha.shape == (B, T, 2 * S + 1)


def test_a_large_op_without_a_rule_is_not_run_on_the_cpu() -> None:
    big = torch.empty(MAX_INPUT_BYTES // 4 + 1, device="meta")
    assert run_for_shapes(torch.ops.aten.abs.default, (big,), {}) is None
    small = torch.empty(3, 4, device="meta")
    out = run_for_shapes(torch.ops.aten.abs.default, (small,), {})
    assert out.shape == (3, 4) and out.is_meta
