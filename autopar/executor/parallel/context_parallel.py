"""Context parallelism: the sequence is split over the cp ranks and attention is made exact again.

torch's own ``context_parallel()`` is CUDA-only (docs/design.md §7), so the three kinds are written here with
autograd over torch.distributed collectives:

* ``ring``: K/V blocks travel around the ring by P2P; each step runs flash attention on the
  pieces the causal mask leaves and merges them by log-sum-exp (executor/parallel/ring_attention.py:
  memory linear in the local sequence, as flash attention's). Every rank runs every send/receive
  step, also where the causal mask empties a block, so forward and backward stay matched on all
  ranks (no deadlock).
* ``allgather``: K/V all-gathered once, the same flash pieces, the gradients reduce-scattered back.
* ``ulysses``: all-to-all (``all_to_all_single_autograd``) turns sequence shards into head shards,
  full-sequence causal attention runs on heads/cp heads, and a second all-to-all turns back.

Causal load balance: the sequence is cut into 2·cp chunks and rank i holds chunks i and 2cp-1-i
(``shard_indices``), so every rank has the same amount of causal work. The model receives its
tokens' true positions (``forward(tokens, positions=...)``), and masks are built from positions,
so any token order is exact. GQA: K/V heads are repeated to the query heads first.

Loss: next-token targets are built on the full sequence *before* sharding (``shard_batch``), each
rank sums the cross-entropy of its tokens and divides by the global target count; the dp x cp
gradient average divides by cp, so the local loss is multiplied by cp (``cp_next_token_loss``).

Hugging Face causal-LM batches (``{"input_ids": ids, "labels": labels}``, the HF Trainer's form):
the model gets only the local ``input_ids`` and their ``position_ids`` -- no labels, so it computes
no loss over a shard -- and the loss is HF's for labels: the target at position i is labels[i+1]
(-100: ignored), the mean over the non-ignored targets of the whole sequence (``dict_batch``).
``is_label_loss`` checks once that the model file's loss_fn is that loss, on a short prefix run
without context parallelism (``local_attention``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.errors import AutoparError
from autopar.executor.parallel.ring_attention import AllGatherAttention, RingAttention, shard_chunks

IGNORE = -100


def shard_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Token indices held by cp ``rank``: chunks ``rank`` and ``2cp-1-rank`` of 2cp equal chunks."""
    if seq_len % (2 * cp):
        # Cannot balance: fall back to contiguous shards (still exact, only less balanced).
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * cp)
    a, b = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """The (b, s) targets of a (b, s) label batch: position i predicts labels[i + 1]; the last
    position, and every position whose next label is -100, is ignored (IGNORE)."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


def shard_batch(tokens: torch.Tensor, cp: int, rank: int, labels: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local tokens, local positions, local next-token targets) of a (b, s) token batch. The
    targets are built on the full sequence from ``labels`` (None: the tokens themselves) before
    sharding, so a shard's last token still predicts the next shard's first."""
    idx = shard_indices(tokens.shape[1], cp, rank).to(tokens.device)
    targets = next_token_targets(tokens if labels is None else labels)
    return tokens[:, idx], idx, targets[:, idx]


def dict_batch(mb: Mapping[str, Any], token_key: str, labels_key: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of a Hugging Face causal-LM micro-batch (spec.token_key / labels_key); the
    labels are the tokens when the batch has none. An attention_mask must be all ones (no padding):
    a shard's attention is full causal and knows no padding mask."""
    mask = mb.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise AutoparError("context parallelism needs attention_mask to be all ones (no padding): pack the "
                           "sequences to full length, or drop attention_mask from the batch")
    tokens = mb[token_key]
    return tokens, (mb[labels_key] if labels_key is not None else tokens)


def num_targets_of(labels: torch.Tensor) -> int:
    """The count of non-ignored next-token targets of a (b, s) label batch, at least 1 (all ignored:
    the loss is 0, where HF's mean over nothing would be NaN)."""
    return max(1, int((next_token_targets(labels) != IGNORE).sum()))


def cp_next_token_loss(logits: torch.Tensor, local_targets: torch.Tensor, num_targets: int, cp: int) -> torch.Tensor:
    """cp x (sum of this rank's token losses) / (global number of targets); see module docstring."""
    vocab = logits.shape[-1]
    total = F.cross_entropy(
        logits.reshape(-1, vocab).float(), local_targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return total * (cp / num_targets)


PROBE_TOKENS = 64  # the loss check's sequence prefix: vocabulary-sized logits of a batch are GBs at scale


def is_next_token_loss(loss_fn, tokens: torch.Tensor, vocab: int, output: Any = None) -> bool:
    """Numerically check that the model file's loss_fn is mean next-token cross-entropy.
    ``output``: a model output of the model's structure (an HF ``ModelOutput``), whose logits the
    check's random logits replace (None: the model returns the logits tensor).

    The check runs on the first row's first ``PROBE_TOKENS`` tokens (a mean over tokens does not
    depend on how many), and on the whole row only where that prefix fails (a loss_fn tied to the
    sequence length): its logits are 1 x s x vocab, where those of a pipeline's whole batch
    (G/dp rows) would not fit a GPU at a 128k vocabulary."""
    row = tokens[:1]
    if row.shape[1] > PROBE_TOKENS and _loss_matches(loss_fn, row[:, :PROBE_TOKENS], vocab, output):
        return True
    return _loss_matches(loss_fn, row, vocab, output)


def _loss_matches(loss_fn, tokens: torch.Tensor, vocab: int, output: Any) -> bool:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*tokens.shape, vocab, generator=g).to(tokens.device)
    want = cp_next_token_loss(logits, shard_batch(tokens, 1, 0)[2], tokens.shape[0] * (tokens.shape[1] - 1), 1)
    try:
        got = loss_fn(logits if output is None else logits_of(output)[1](logits), tokens)
    except Exception:  # noqa: BLE001 - a loss_fn that cannot take this output is not the CP loss
        return False
    return bool(torch.isclose(got.float(), want, rtol=1e-5, atol=1e-6))


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def is_label_loss(model: nn.Module, loss_fn: Callable, mb: Mapping[str, Any], token_key: str,
                  labels_key: str | None, cp: int) -> bool:
    """Whether ``loss_fn(model(**batch), batch)`` equals the mean next-token cross-entropy over the
    batch's labels (``next_token_targets``), on the first 2·cp tokens of ``mb`` run without context
    parallelism (every cp rank runs the same; collective where the model's data/tensor parallelism
    is). Real labels are kept where the prefix has a target; a prefix whose targets are all ignored
    (an SFT prompt) takes its tokens as labels, so the check still sees a loss."""
    n = min(mb[token_key].shape[1], 2 * cp)
    prefix = {k: v[:, :n] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v for k, v in mb.items()}
    if labels_key is not None and not bool((next_token_targets(prefix[labels_key]) != IGNORE).any()):
        prefix[labels_key] = prefix[token_key].clone()
    labels = prefix[labels_key] if labels_key is not None else prefix[token_key]
    with torch.no_grad(), local_attention(model):
        output = model(**prefix)
        try:
            got = loss_fn(output, prefix)
        except Exception:  # noqa: BLE001 - a loss_fn that cannot take this output is not the CP loss
            return False
        want = cp_next_token_loss(logits_of(output)[0], next_token_targets(labels), num_targets_of(labels), 1)
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return False
    return bool(torch.isclose(_full(got).float().reshape(()), _full(want).float(), rtol=1e-4, atol=1e-5))


def logits_of(output: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """The logits in a model's output -- the tensor itself, or the first 3-d tensor of a tuple,
    dict or HF ``ModelOutput`` -- and a function putting other logits in their place (the other
    tensors of the output as zeros, their structure kept)."""
    if isinstance(output, torch.Tensor):
        return output, lambda new: new
    leaves, spec = tree_flatten(output)
    i = next((j for j, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.dim() == 3), None)
    if i is None:
        raise ValueError(f"context parallelism: the model's output ({type(output).__name__}) holds no (b, s, vocab) logits")

    def put(new: torch.Tensor) -> Any:
        out = [torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for v in leaves]
        out[i] = new
        return tree_unflatten(out, spec)

    return leaves[i], put


def position_kwargs(accepts_positions: bool, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """How the model's forward is told where its shard's tokens sit: autopar's ``positions=``, or
    transformers' ``position_ids=`` (shape (1, s_local), read by the rotary tables)."""
    return {"positions": positions} if accepts_positions else {"position_ids": positions[None]}


def autocast_operand(q: torch.Tensor) -> torch.Tensor:
    """``q`` in autocast's dtype where autocast is on for its device and ``q`` is fp32 -- what
    autocast does to ``scaled_dot_product_attention`` (the Ulysses kind's, a one-rank run's). The
    ring's flash calls need it: autocast has no rule for the flash backward op, which got the fp32
    tensors the function saved (FlashAttention-2 takes 16 bits only); and a query arrives in fp32
    under autocast wherever the model's rotary tables are fp32 (Hugging Face Llama multiplies its
    16-bit projections by them)."""
    device = q.device.type
    if q.dtype != torch.float32 or not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return q
    return q.to(torch.get_autocast_dtype(device))


class ContextParallelAttention(nn.Module):
    """Drop-in replacement of a block's attention core for one cp rank (inputs are local shards)."""

    def __init__(self, kind: str, group: dist.ProcessGroup, cp: int, rank: int, seq_len: int) -> None:
        super().__init__()
        self.kind, self.group, self.cp, self.rank = kind, group, cp, rank
        self.positions = [shard_indices(seq_len, cp, r) for r in range(cp)]  # plain list: not a buffer
        self.chunks = [shard_chunks(seq_len, cp, r) for r in range(cp)]  # the same, as ranges
        self.local = False  # set by local_attention
        # Ulysses' (order, inverse order) on each device, moved there once: a host tensor's copy to
        # a GPU waits for the stream to drain, once per block and micro-batch if made per call
        self._orders: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def orders(self, device: torch.device, fake: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank order -> natural sequence order, its inverse) on ``device``; cached per device
        except for ``fake`` tensors (a rehearsal's: made under a fake mode, they may not outlive it)."""
        hit = None if fake else self._orders.get(device)
        if hit is None:
            order = torch.argsort(torch.cat(self.positions))
            hit = (order.to(device), torch.argsort(order).to(device))
            if not fake:
                self._orders[device] = hit
        return hit

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Causal attention of the local (b, heads, s_local, head_dim) shards; ``scale`` defaults
        to 1/sqrt(head_dim) (transformers passes its ``scaling``). Inside ``local_attention``:
        plain causal attention of q, k, v as a whole sequence from position 0, no collectives."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        gqa = k.shape[1] != q.shape[1]  # grouped-query attention: fewer K/V heads, each shared
        if self.local:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        # the ring's flash calls need autocast's dtype (autocast_operand); Ulysses' SDPA would cast
        # after its all-to-alls, so casting first moves half the bytes of an fp32 query, as priced
        q = autocast_operand(q)
        if k.dtype != q.dtype or v.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        if self.kind in ("ring", "allgather"):  # flash kernels block by block (executor/parallel/ring_attention.py)
            fn = RingAttention if self.kind == "ring" else AllGatherAttention
            return fn.apply(q, k, v, self.group, self.cp, self.rank, self.chunks, scale)
        if gqa and k.shape[1] % self.cp:  # Ulysses splits the kv heads too: repeat only where cp must
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        from torch._subclasses.fake_tensor import is_fake

        return self._ulysses(q, k, v, self.orders(q.device, is_fake(q) or q.device.type == "meta"), scale)

    def _ulysses(self, q, k, v, orders, scale):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        b, h, s_l, d = q.shape
        cp = self.cp

        def to_heads(x: torch.Tensor) -> torch.Tensor:  # (b, n, s_l, d) -> (b, n/cp, s, d) in rank order
            n = x.shape[1]
            y = all_to_all_single_autograd(x.permute(1, 0, 2, 3).contiguous(), None, None, self.group)
            return y.view(cp, n // cp, b, s_l, d).permute(2, 1, 0, 3, 4).reshape(b, n // cp, cp * s_l, d)

        order, back = orders  # rank order -> natural sequence order, and back
        qs, ks, vs = (to_heads(x)[:, :, order] for x in (q, k, v))
        # Rank r holds q heads [r h/cp, (r+1) h/cp) and kv heads [r kv/cp, ...): the groups line up.
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[1] != h // cp)
        o = o[:, :, back].reshape(b, h // cp, cp, s_l, d).permute(2, 1, 0, 3, 4).reshape(h, b, s_l, d)
        back = all_to_all_single_autograd(o.contiguous(), None, None, self.group)
        return back.view(h, b, s_l, d).permute(1, 0, 2, 3)


@contextmanager
def local_attention(model: nn.Module) -> Iterator[None]:
    """Every ContextParallelAttention of ``model`` (a block's core, or one a transformers attention
    module routes to: executor/parallel/hf_attention.py keeps it on the module, not as a submodule) runs as
    plain causal attention inside: the model can run a whole short sequence on each rank alone."""
    found = []
    for mod in model.modules():
        route = getattr(mod, "_autopar_attention", None)  # hf_attention._ATTR
        for cand in (mod, getattr(route, "cp", None)):
            if isinstance(cand, ContextParallelAttention) and all(cand is not f for f in found):
                found.append(cand)
    for cand in found:
        cand.local = True
    try:
        yield
    finally:
        for cand in found:
            cand.local = False


def apply_cp(part: nn.Module, blocks_path: str, core_name: str, *, kind: str, group: dist.ProcessGroup, cp: int,
             rank: int, seq_len: int) -> None:
    """Replace the attention core of every block of ``part`` by a ContextParallelAttention."""
    blocks = part.get_submodule(blocks_path)
    for key, block in blocks.named_children():
        if not key.isdigit():
            continue
        parent_name, _, leaf = core_name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        setattr(parent, leaf, ContextParallelAttention(kind, group, cp, rank, seq_len))
