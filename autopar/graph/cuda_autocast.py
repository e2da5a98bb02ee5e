"""What CUDA's ``torch.autocast`` keeps for backward, for a step traced in 16 bits.

A data-parallel kind without FSDP2's ``param_dtype`` (DDP, one unwrapped rank: the executor's
``train.py``) trains under ``torch.autocast`` over fp32 parameters. The planner's trace runs the
model in the training dtype, without autocast (the meta device has none), so its saved tensors are
what FSDP2's mixed precision keeps. Under autocast the same step keeps other bytes, decided by the
op lists of CUDA's autocast (PyTorch's "Automatic Mixed Precision" reference):

* the residual stream is fp32: the embedding reads an fp32 table and every add promotes, so a
  normalization saves an fp32 input;
* an op of the lower-precision list (``mm``, ``bmm``, convolutions, attention kernels) casts an
  fp32 operand to 16 bits and saves that copy -- one copy per op: autocast caches the casts of
  leaf parameters only, so separate q, k and v projections of one fp32 norm output save three;
* an op of the fp32 list (softmax, log-softmax, layer and group norm, ``pow``, ``rsqrt``, ``exp``,
  ``sum``, the losses) computes in fp32: what it saves -- its input's fp32 copy, or its output --
  is fp32 (explicit attention's probabilities: 4 bytes, plus the 16-bit copy the next ``bmm``
  saves).

``AutocastShadow`` follows each tensor's dtype under those rules beside the trace (its "shadow"
size) and prices every saved tensor as autocast would keep it (``SavedRecord.autocast_nbytes``).
``cuda_fp32_functions`` is the other half: a CPU rehearsal runs CPU autocast, whose fp32 list is
the losses only; the mode makes the fp32 list CUDA's, so a rehearsal of a GPU plan keeps what the
GPU keeps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The lower-precision list, as aten ops after autograd (linear, matmul and einsum reach these).
LOWER_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "addr", "mv", "dot", "convolution", "_convolution",
    "_grouped_mm", "_prelu_kernel",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
})
# The fp32 list, as aten ops (softmax(dtype=fp32), layer_norm, ... reach these).
FP32_OPS = frozenset({
    "_softmax", "_log_softmax", "native_layer_norm", "native_group_norm", "pow", "rsqrt", "exp", "expm1",
    "log", "log10", "log2", "log1p", "reciprocal", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softplus",
    "sum", "cumsum", "cumprod", "prod", "linalg_vector_norm", "norm", "renorm", "logsumexp",
    "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy_with_logits", "kl_div", "_cdist_forward", "_pdist_forward",
})
# Of the fp32 list, the ops whose backward reads their input: under autocast that is an fp32 copy.
FP32_SAVES_INPUT = frozenset({
    "native_layer_norm", "native_group_norm", "pow", "log", "log10", "log2", "log1p", "acos", "asin", "cosh",
    "sinh", "tan", "erfinv", "softplus", "cumprod", "prod", "linalg_vector_norm", "norm", "renorm",
    "logsumexp", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits",
    "kl_div", "_cdist_forward",
})
# Ops whose backward reads their output (saved in the output's own dtype).
SAVES_OUTPUT = frozenset({
    "_softmax", "_log_softmax", "exp", "expm1", "rsqrt", "reciprocal", "sqrt", "tanh", "sigmoid", "logsumexp",
    "relu", "elu",
})
# A cast to, or a tensor made in, the training dtype: the model read that dtype from a tensor or a
# parameter, which autocast leaves fp32 (``x.to(input_dtype)`` of Hugging Face's RMSNorm); where it
# read it off a GEMM's output the cast is to 16 bits, so this prices such a tensor over, never under.
_TO_MODEL_DTYPE = frozenset({"_to_copy", "to", "zeros", "ones", "full", "empty", "arange", "zeros_like",
                             "ones_like", "full_like", "scalar_tensor", "randn", "rand", "tensor"})
# Ops whose output takes their input's dtype whatever their fp32 weights and statistics (on no
# autocast list: cuDNN's batch norm computes a 16-bit input beside fp32 parameters).
_INPUT_DTYPE_OPS = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                              "_batch_norm_with_update", "_batch_norm_no_update", "cudnn_batch_norm"})
_FP32_BYTES = 4


def _is_16bit(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float16)


class AutocastShadow:
    """The size per element each 16-bit tensor of a trace would have under CUDA's autocast over
    fp32 parameters, and what the forward does with it (module docstring). Fed every non-view op
    of the forward by the recorder, in order; tensors are named by their root's id (views share
    their root's). A tensor no op made (a parameter, a buffer, an input) is fp32 under autocast."""

    def __init__(self) -> None:
        self.size: dict[int, int] = {}  # root id -> bytes per element under autocast (16-bit roots)
        self.gemm_reads: dict[int, int] = {}  # root id -> lower-precision ops that read it
        self.fp32_saves: set[int] = set()  # roots an fp32-list op saves (as its fp32 copy)
        self.saved_outputs: set[int] = set()  # roots their own op saves as its output

    def size_of(self, rid: int) -> int:
        return self.size.get(rid, _FP32_BYTES)

    def op(self, name: str, ins: list[tuple[int, torch.Tensor]], outs: list[tuple[int, torch.Tensor]],
           forward: bool) -> None:
        """One op: ``ins``/``outs`` as (root id, tensor); only the forward's reads save for backward."""
        floats_in = [(rid, t) for rid, t in ins if t.is_floating_point()]
        for rid, t in floats_in:
            if not forward or not _is_16bit(t):
                continue
            if name in LOWER_OPS:
                self.gemm_reads[rid] = self.gemm_reads.get(rid, 0) + 1
            elif name in FP32_SAVES_INPUT:
                self.fp32_saves.add(rid)
        first = next(((rid, t) for rid, t in floats_in if _is_16bit(t)), None)
        if name in LOWER_OPS:
            size = 2
        elif first is not None and (name in _INPUT_DTYPE_OPS or name in ("_to_copy", "to")):
            size = self.size_of(first[0])  # a norm of its input's dtype; a copy that casts nothing
        elif name in FP32_OPS or name in _TO_MODEL_DTYPE or not floats_in:
            size = _FP32_BYTES
        else:  # type promotion: the widest floating input
            size = max(self.size_of(rid) if _is_16bit(t) else t.element_size() for rid, t in floats_in)
        for rid, t in outs:
            if not _is_16bit(t):
                continue
            if name in SAVES_OUTPUT:
                self.saved_outputs.add(rid)
            self.size.setdefault(rid, size)  # an in-place op keeps its tensor's dtype

    def factor(self, rid: int, t: torch.Tensor) -> float:
        """Bytes autocast keeps for the saved 16-bit root ``rid`` per byte the trace saved: each
        lower-precision reader saves its own 16-bit copy of an fp32 tensor (one tensor, if it is
        16-bit already), an fp32-list reader its fp32 copy, and any other saver -- the op that made
        it, or a reader of neither list -- the tensor itself."""
        if not _is_16bit(t):
            return 1.0
        size, reads = self.size_of(rid), self.gemm_reads.get(rid, 0)
        fp32 = rid in self.fp32_saves
        itself = rid in self.saved_outputs or (reads == 0 and not fp32)
        if size == 2:
            per = 2.0 * (reads > 0 or itself) + _FP32_BYTES * fp32
        else:
            per = 2.0 * reads + _FP32_BYTES * (fp32 or itself)
        return per / t.element_size()


def _fp32_functions() -> dict[Any, str]:
    """CUDA's fp32 list at the Python surface: what a CPU autocast computes in 16 bits and CUDA's in fp32."""
    names = ["softmax", "log_softmax", "layer_norm", "group_norm", "pow", "rsqrt", "exp", "expm1", "log",
             "log10", "log2", "log1p", "reciprocal", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "sum",
             "cumsum", "cumprod", "prod", "norm", "renorm", "logsumexp", "dist", "cdist"]
    out: dict[Any, str] = {}
    for name in names:
        for owner in (torch, torch.Tensor):
            fn = getattr(owner, name, None)
            if fn is not None:
                out[fn] = name
    for name in ["softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "softplus", "normalize",
                 "cosine_similarity", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
                 "binary_cross_entropy_with_logits", "nll_loss", "poisson_nll_loss", "cosine_embedding_loss",
                 "hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss", "multi_margin_loss",
                 "multilabel_margin_loss", "triplet_margin_loss", "pdist"]:
        out[getattr(F, name)] = name
    for name in ["__pow__", "__rpow__", "__rtruediv__", "__rdiv__"]:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            out[fn] = name
    return out


class _CudaFp32Functions(TorchFunctionMode):
    """While CPU autocast is on, runs CUDA autocast's fp32 list in fp32: 16-bit floating arguments
    cast to fp32 first (an explicit ``dtype=`` argument opts out, as on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.functions = _fp32_functions()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = self.functions.get(func)
        if name is None or not torch.is_autocast_enabled("cpu") or kwargs.get("dtype") is not None:
            return func(*args, **kwargs)

        def up(a: Any) -> Any:
            return a.float() if isinstance(a, torch.Tensor) and _is_16bit(a) else a

        with torch.autocast("cpu", enabled=False):
            return func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})


def cuda_fp32_functions() -> TorchFunctionMode:
    """The mode that gives a CPU autocast CUDA's fp32 list (module docstring)."""
    return _CudaFp32Functions()
