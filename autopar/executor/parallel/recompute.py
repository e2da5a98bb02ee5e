"""Activation recompute with ``torch.utils.checkpoint`` (non-reentrant).

* ``full``: each block's forward runs under checkpoint; only its input is kept and the whole block
  is re-run in backward.
* ``selective`` (Korthikanti et al.): only the attention core (the s^2 softmax part, GPT's
  ``attn.core`` / Llama's ``attention.core``) is recomputed.
* ``op`` (per-op selective, torchtitan's ``selective_ac_option: op``): each block runs under
  checkpoint with torch's selective checkpoint contexts; the policy of autopar.recompute_ops keeps
  every other matrix product's output, the attention kernel's and a reduce-scatter's, and backward
  re-runs the rest.
* a per-stage mix (``parallel.recompute_blocks``): each block gets its own mode, by the rule of
  ``Plan.block_recompute`` (a rank's first blocks full, then selective, then none).

The checkpoint is installed by overriding the module instance's ``forward`` rather than wrapping the
module, so parameter names do not change (plans, state dicts and FSDP2 see the same names). Applied
before FSDP2/DDP: FSDP2's pre-backward hook then unshards the block's parameters before the
recompute runs, as in torchtitan's order (AC inside, FSDP outside).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.executor.runtime.introspect import ModelSpec
from autopar.recompute_ops import COUNTED_GEMMS, SAVED_ATTENTION, SAVED_COLLECTIVES, saves_gemm


def _packets(namespace: Any, names: Sequence[str]) -> frozenset:
    return frozenset(getattr(namespace, n) for n in names if hasattr(namespace, n))


_GEMMS = _packets(torch.ops.aten, COUNTED_GEMMS)
_KEPT = _GEMMS | _packets(torch.ops.aten, SAVED_ATTENTION) | _packets(torch.ops._c10d_functional, SAVED_COLLECTIVES)


def op_policy_context() -> tuple[Any, Any]:
    """The context pair one checkpointed call of a block runs under (``context_fn``): a fresh GEMM
    count per call, kept apart for the forward and its recompute, so both number a block's GEMMs
    alike and the recompute finds each kept output where the forward left it."""
    counts: Counter = Counter()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(func, "_overloadpacket", func)
        if packet not in _KEPT:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if packet in _GEMMS:
            counts[ctx.is_recompute] += 1
            if not saves_gemm(counts[ctx.is_recompute]):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_forward(module: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None = None) -> None:
    inner = module.forward  # bound method of the class (or an earlier override)
    extra = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward  # instance attribute shadows the class method


def _blocks(part: nn.Module, spec: ModelSpec) -> list[tuple[str, nn.Module]]:
    """The blocks of ``part`` to checkpoint: a layer chain's units (executor/parallel/chain_pipeline.py), else
    the digit-named children of the block list."""
    if spec.chain is not None:
        from autopar.executor.parallel.chain_pipeline import unit_modules

        container = spec.chain.units[0].rsplit(".", 1)[0]  # spec.blocks_path, before a stage's "model." prefix
        prefix = spec.blocks_path[: len(spec.blocks_path) - len(container)]
        return [(str(i), m) for i, m in enumerate(unit_modules(part, spec, prefix))]
    return [(k, b) for k, b in part.get_submodule(spec.blocks_path).named_children() if k.isdigit()]


def apply_recompute(part: nn.Module, spec: ModelSpec, mode: str, block_modes: Sequence[str] | None = None) -> int:
    """Install recompute on every block of ``part``; returns how many modules were wrapped.

    ``block_modes`` (per-stage recompute, a plan's ``recompute_blocks``: ``Plan.block_recompute``): the mode
    of each block by its index in the whole model, instead of ``mode`` for all. Blocks keep their
    original indices as names in a pipeline chunk, so a chunk reads its own blocks' modes."""
    if mode == "none" and block_modes is None:
        return 0
    count = 0
    for key, block in _blocks(part, spec):
        if block_modes is not None:
            mode = block_modes[int(key)]
        if mode == "none":
            continue
        if mode == "full":
            _checkpoint_forward(block)
        elif mode == "op":
            _checkpoint_forward(block, op_policy_context)
        elif mode == "selective":
            assert spec.core_name is not None, "preflight guarantees an attention core"
            _checkpoint_forward(block.get_submodule(spec.core_name))
        else:
            raise ValueError(f"unknown recompute mode {mode!r}")
        count += 1
    return count
