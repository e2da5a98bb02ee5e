"""What per-op selective recompute (``parallel.recompute: op``) keeps, stated once for the executor
(executor/parallel/recompute.py, which installs it with torch's selective checkpoint contexts) and the cost
model (cost/compute.py, which prices it from the traced ops). Plain data: no torch.

The policy is torchtitan's ``selective_ac_option: op`` (torchtitan/models/llama3 parallelize, its
``_save_list`` and ``_custom_policy``), counted per checkpointed block:

* the output of every odd-numbered matrix product (the 1st, 3rd, 5th ... ``mm`` of the block's
  forward; the even ones are recomputed: half the GEMM FLOPs re-run for half the GEMM outputs);
* the outputs of the fused attention kernel (flash, memory-efficient or cuDNN SDPA: the output and
  its log-sum-exp), so backward never re-runs attention;
* the output of a tensor-parallel reduce-scatter, so backward never repeats it;

and the block's input, which checkpoint keeps. Everything else (norms, activations, rotary
embeddings, residual adds, all-gathers) is recomputed in backward. autopar counts ``addmm`` (a
Linear with a bias) with ``mm``: torchtitan's models have no biases, so on them the two agree.
"""

from __future__ import annotations

# aten op names (the overload packet's name, as graph/trace.py records them)
COUNTED_GEMMS = ("mm", "addmm")
SAVED_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention", "_flash_attention_forward")
SAVED_COLLECTIVES = ("reduce_scatter_tensor",)


def saves_gemm(count: int) -> bool:
    """Whether the ``count``-th (1-based) counted GEMM of a block's forward keeps its output."""
    return count % 2 == 1
