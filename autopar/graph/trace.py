"""Record what one forward+backward does on the meta device: every aten op and every saved tensor.

The recorder is a ``TorchDispatchMode``: it sees each aten op after autograd, so it sees the real
decomposition PyTorch runs (``addmm``, ``bmm``, ``native_layer_norm``, their backward kernels). FLOPs
come from ``torch.utils.flop_counter``'s registry, the same table ``FlopCounterMode`` uses; bytes
moved are the sizes of the op's tensor inputs and outputs (view ops move nothing). Saved-for-backward
tensors come from ``saved_tensors_hooks``; parameters (and views of them) are not activations and are
left out, and a tensor saved by two ops is counted once; a saved view counts the storage it keeps
alive, once however many views of it are saved.

Two ops are measured the way a CUDA device runs them, not the way the CPU fallback does, because
autoplan plans GPU clusters: ``F.dropout`` becomes ``native_dropout`` (a 1-byte mask is saved, not
a same-dtype mask) and ``F.scaled_dot_product_attention`` becomes the flash-attention kernel (saves
q, k, v, out and log-sum-exp; no s^2 scores), or with an explicit mask the memory-efficient one.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from autopar.graph.cuda_autocast import AutocastShadow, cuda_fp32_functions
from autopar.graph.records import OpRecord, SavedRecord, Trace
from autopar.spec.meta import call_on_meta
from autopar.spec.meta_memo import flat_tensors

GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm"}
# Grouped GEMMs (one matmul per expert of a mixture of experts, ``torch._grouped_mm``): not in
# torch's flop registry, counted here (``_grouped_mm_cost``).
GROUPED_GEMM_OPS = {"_grouped_mm"}
# Convolutions run as implicit GEMMs (cuDNN, oneDNN): kind "mem" like any other op, but with the
# GEMM's dims recorded, so the cost model takes the larger of their traffic and their FLOPs at that
# GEMM's rate (cost/compute.py ``op_time_s``).
CONV_OPS = {"convolution", "convolution_backward"}
ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
}
# Ops that only bookkeep (no kernel on a GPU).
# new_empty_strided is autograd allocating a weight gradient's buffer (its copy_ is the traffic);
# _unsafe_view is a reshape that aliases its input (its schema just does not say so).
_FREE_OPS = {"detach", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
             "_local_scalar_dense", "alias", "_unsafe_view"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage ``t`` lives in (what saving any view of it keeps alive)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
        return _nbytes(t)


def _gemm_dims(name: str, args: tuple) -> tuple[int, int, int, int]:
    if name == "mm":
        a, b = args[0], args[1]
        return (1, a.shape[0], b.shape[1], a.shape[1])
    if name == "addmm":
        a, b = args[1], args[2]
        return (1, a.shape[0], b.shape[1], a.shape[1])
    a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
    return (a.shape[0], a.shape[1], b.shape[2], a.shape[2])


def _conv_gemms(name: str, args: tuple, out: object, flops: float) -> tuple[tuple[int, int, int, int] | None, float]:
    """(dims, FLOPs) of a convolution's implicit GEMMs. dims: (GEMMs, rows, columns, depth) -- one
    GEMM per group (the backward: per group and gradient it computes, the input's and the
    weight's), a row per output position of each sample, a column per output channel of the group,
    the depth the group's input channels x kernel taps. torch's count of a grouped convolution's
    backward ignores the groups (a depthwise conv1d's came out 17x its two GEMMs), so the backward of
    a plain (not transposed) convolution is counted from those dims; elsewhere the depth is what
    torch's count leaves."""
    backward = name == "convolution_backward"
    y = args[0] if backward else out  # the output, or its gradient
    if not isinstance(y, torch.Tensor) or y.dim() < 3 or flops <= 0:
        return None, flops
    groups = int(args[9] if backward else args[8])
    gemms = groups * (max(1, sum(bool(m) for m in args[10][:2])) if backward else 1)
    rows, cols = y.numel() // y.shape[1], y.shape[1] // groups
    if not rows or not cols:
        return None, flops
    weight = args[2] if backward else args[1]
    if backward and not args[7] and isinstance(weight, torch.Tensor):
        depth = weight[0].numel()  # (out channels, in channels / groups, *taps)
        return (gemms, rows, cols, depth), 2.0 * gemms * rows * cols * depth
    depth = flops / (2.0 * gemms * rows * cols)
    return ((gemms, rows, cols, max(1, round(depth))) if depth > 0 else None), flops


def _attention_dims(name: str, args: tuple) -> tuple[int, int, int, int] | None:
    """(batch x heads, query length, key length, head dim) of a fused attention op: its key length
    prices the kernel's efficiency (cost/compute.py), which is not the model's sequence where the
    keys are image patches or a fixed-length encoder output. The backward ops take the output's
    gradient first; ``_flash_attention_*`` keep (batch, seq, heads, dim), the others (batch, heads,
    seq, dim)."""
    at = 1 if name.endswith("_backward") else 0
    q, k = (args[at], args[at + 1]) if len(args) > at + 1 else (None, None)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 == k.dim()):
        return None
    if name.startswith("_flash_attention"):
        return (q.shape[0] * q.shape[2], q.shape[1], k.shape[1], q.shape[3])
    return (q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3])


def _is_causal(func: Any, args: tuple, kwargs: dict) -> bool:
    """The ``is_causal`` argument of a fused attention op, found by name in its schema (its position
    differs between the flash, memory-efficient and cuDNN kernels and their backward ops)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            value = kwargs.get("is_causal", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return False


def _grouped_mm_cost(args: tuple, kwargs: dict) -> tuple[float, tuple[int, int, int, int]]:
    """(FLOPs, (batch, m, n, k)) of ``torch._grouped_mm(a, b, offs)``. Its four layouts (the
    group size G is the leading dimension of the 3-D operand, or of ``offs``):

        2d x 3d  a (M, K),    b (G, K, N)  -> (M, N)      each row meets its group's (K, N) matrix
        3d x 2d  a (G, M, K), b (K, N)     -> (M, N)      each column block meets its group's a
        2d x 2d  a (M, K),    b (K, N)     -> (G, M, N)   K is split into groups (weight gradients)
        3d x 3d  a (G, M, K), b (G, K, N)  -> (G, M, N)   a batched matmul

    On meta the offsets hold no values: every row is taken as routed (the rows past the last
    offset, which the kernel skips, are expert-parallel sentinels that a single rank has none of)."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    groups = int(offs.shape[0]) if isinstance(offs, torch.Tensor) else 1
    if a.dim() == 2 and b.dim() == 3:
        m, k, n = a.shape[0], a.shape[1], b.shape[2]
        return 2.0 * m * k * n, (1, m, n, k)
    if a.dim() == 3 and b.dim() == 2:
        m, k, n = a.shape[1], a.shape[2], b.shape[1]
        return 2.0 * m * k * n, (1, m, n, k)
    if a.dim() == 2 and b.dim() == 2:
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        return 2.0 * m * k * n, (groups, m, n, max(1, k // max(1, groups)))
    g, m, k, n = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
    return 2.0 * g * m * k * n, (g, m, n, k)


class _Recorder(TorchDispatchMode):
    """Records each non-view op. A view (or a bookkeeping op such as ``detach``) names its output
    after the tensor it views, so that reading a view of an op's output counts as reading that
    output when element-wise fusion is modelled (``apply_fusion``).

    The view map is a forest, never a cycle: each entry points at a root (a tensor that views
    nothing), and an op that returns its own input (``lift_fresh`` of ``torch.tensor(...)``, an
    alias of a view) adds no entry. Tensor ids stay unique because every tensor the recorder sees
    is kept alive until the trace ends (meta tensors cost no memory)."""

    def __init__(self, trace: Trace, state: "_State") -> None:
        super().__init__()
        self.trace = trace
        self.state = state
        self.alive: list[torch.Tensor] = []  # keeps outputs alive so tensor ids stay unique
        self.root: dict[int, int] = {}  # id of a view -> id of the root tensor it views
        self.io: list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = []
        self.gemm_inputs: set[int] = set()  # roots of the activation operands of mm / addmm
        self.root_bytes: dict[int, int] = {}  # id of a root tensor -> its bytes (OpRecord.ins)
        self.autocast = AutocastShadow()  # the dtypes CUDA's autocast would give (SavedRecord.autocast_factor)

    def _rid(self, t: torch.Tensor) -> int:
        return self._rid_of(id(t))

    def _rid_of(self, i: int) -> int:
        # Entries point at roots, so this is usually one step; a root that later became a view
        # itself (an op returned an existing tensor as a view of another) adds a step. The walk is
        # bounded by the map's size, so it ends whatever the map holds.
        for _ in range(len(self.root) + 1):
            nxt = self.root.get(i)
            if nxt is None or nxt == i:
                return i
            i = nxt
        return i

    def _note_view(self, out: torch.Tensor, of: torch.Tensor) -> None:
        root = self._rid(of)
        if root == id(of):
            self.root_bytes.setdefault(root, _nbytes(of))
        if root != id(out):  # returning the input itself (or what it views) makes no entry
            self.root[id(out)] = root

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = call_on_meta(func, args, kwargs)  # a meta kernel that refuses a dtype the GPU kernel takes
        name = func._overloadpacket.__name__
        flat_in = flat_tensors((args, kwargs))  # pytree's order at a fraction of its cost (hot path)
        flat_out = flat_tensors(out)
        self.alive.extend(flat_out)
        self.alive.extend(flat_in)
        is_view = name in _FREE_OPS or (bool(func._schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        ))
        if is_view:
            if flat_in:
                for o in flat_out:
                    self._note_view(o, flat_in[0])
            return out
        out_bytes = sum(_nbytes(t) for t in flat_out)
        moved = sum(_nbytes(t) for t in flat_in) + out_bytes
        flops = 0.0
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        kind, dims, causal = "mem", None, False
        if name in GEMM_OPS:
            kind, dims = "gemm", _gemm_dims(name, args)
            if name in ("mm", "addmm") and self.state.phase == "fwd":
                self.gemm_inputs.add(self._rid(args[0] if name == "mm" else args[1]))
        elif name in GROUPED_GEMM_OPS:
            flops, dims = _grouped_mm_cost(args, kwargs)
            kind = "gemm"
        elif name in ATTENTION_OPS:
            kind, dims, causal = "attn", _attention_dims(name, args), _is_causal(func, args, kwargs)
        elif name in CONV_OPS:
            dims, flops = _conv_gemms(name, args, out, flops)
        ins = tuple((self._rid(t), _nbytes(t)) for t in flat_in)
        for t in flat_in:
            self.root_bytes.setdefault(id(t), _nbytes(t))
        for t in flat_out:
            self.root_bytes.setdefault(self._rid(t), _nbytes(t))
        outs = tuple((self._rid(t), _nbytes(t)) for t in flat_out)  # an in-place op writes what it views
        self.autocast.op(name, [(rid, t) for (rid, _), t in zip(ins, flat_in)],
                         [(rid, t) for (rid, _), t in zip(outs, flat_out)], self.state.phase == "fwd")
        self.trace.ops.append(
            OpRecord(name=name, phase=self.state.phase, region=self.state.region, kind=kind,
                     flops=flops, bytes=float(moved), dims=dims, out_bytes=float(out_bytes), causal=causal,
                     ins=tuple((rid, float(n), float(self.root_bytes.get(rid, n))) for rid, n in ins),
                     outs=tuple((rid, float(n), float(self.root_bytes.get(rid, n))) for rid, n in outs),
                     out_numel=float(sum(t.numel() for t in flat_out)),
                     in_numel=float(max((t.numel() for t in flat_in), default=0)))
        )
        self.io.append((ins, tuple((id(t), _nbytes(t)) for t in flat_out)))
        return out

    def apply_fusion(self, saved_ids: set[int]) -> None:
        """Model element-wise kernel fusion (Megatron's fused kernels, torch.compile): when an
        element-wise op consumes the output of the element-wise op just before it, that
        intermediate is not read back from memory, and not written at all unless something else
        needs it (a later op, or autograd saving it for backward)."""
        uses: dict[int, int] = {}
        for ins, _ in self.io:
            for rid, _ in ins:
                uses[rid] = uses.get(rid, 0) + 1
        ops = self.trace.ops
        for k in range(1, len(ops)):
            cur, prev = ops[k], ops[k - 1]
            if cur.kind != "mem" or prev.kind != "mem" or cur.phase != prev.phase or cur.region != prev.region:
                continue
            prev_out = dict(self.io[k - 1][1])
            saving = 0.0
            for rid, nbytes in self.io[k][0]:
                if rid in prev_out:
                    saving += nbytes
                    if uses.get(rid, 0) <= 1 and rid not in saved_ids:
                        saving += prev_out[rid]
            if saving:
                ops[k] = dataclasses.replace(cur, bytes=max(0.0, cur.bytes - saving))


@dataclass(kw_only=True)
class _State:
    phase: str = "fwd"
    region: str = "pre"


class _CudaLikeFunctions(TorchFunctionMode):
    """Route dropout and SDPA to the kernels a CUDA device runs (see module docstring).

    ``nn.MultiheadAttention`` calls SDPA from inside ``F.multi_head_attention_forward``, where a
    function mode no longer sees calls (it is off while it handles one): for that call the
    module-level SDPA it looks up is the flash one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return _flash_sdpa(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _flash_sdpa
            try:
                return func(*args, **kwargs)
            finally:
                F.scaled_dot_product_attention = original
        return func(*args, **kwargs)


def cuda_like_functions() -> TorchFunctionMode:
    """The function mode that routes dropout and SDPA to the CUDA kernels (``_CudaLikeFunctions``)."""
    return _CudaLikeFunctions()


@contextmanager
def cuda_like_functions_everywhere() -> Iterator[None]:
    """``cuda_like_functions`` for a whole process, backward included: dropout and SDPA are replaced
    in ``torch.nn.functional`` itself, so the recompute that ``torch.utils.checkpoint`` runs inside
    backward -- where a function mode entered around the step is not -- runs the same kernels as
    the forward it repeats (checkpoint compares what the two saved). For a process of its own (a
    rehearsal's rank); restored on exit. Where the step runs under autocast, what CUDA's autocast
    computes in fp32 and a CPU's in 16 bits runs in fp32 (graph/cuda_autocast.py)."""
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def routed_sdpa(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        F.scaled_dot_product_attention = sdpa  # _flash_sdpa falls back to SDPA itself (GQA with a mask)
        try:
            return _flash_sdpa(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = routed_sdpa

    F.dropout, F.scaled_dot_product_attention = _dropout, routed_sdpa
    try:
        with cuda_fp32_functions():  # CUDA autocast's fp32 list (softmax, norms, pow, ...) on a CPU autocast
            yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    if not training or p == 0.0:
        return input
    return torch.native_dropout(input, p, True)[0]


# The biases ``_flash_sdpa`` made from a self-attention's boolean mask (SavedRecord.attention_bias)
ATTENTION_BIASES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if attn_mask is not None:
        # Flash kernels take no explicit mask: a CUDA device runs the memory-efficient kernel, which
        # takes it as an additive bias (a boolean mask converted first, as SDPA does) and saves
        # q, k, v, out and the log-sum-exp like flash -- no s^2 scores. Query and key heads that
        # differ (GQA) it cannot take: PyTorch then runs the math kernel, and so is it measured.
        if key.shape[-3] == query.shape[-3]:
            bias = attn_mask
            if attn_mask.dtype == torch.bool:
                bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    attn_mask.logical_not(), float("-inf"))
                if query.shape[-2] == key.shape[-2]:  # self-attention: queries x keys, both the sequence
                    ATTENTION_BIASES[bias] = True
            bias = bias.expand(query.shape[0], query.shape[-3], query.shape[-2], key.shape[-2])
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if value.shape[-1] != query.shape[-1]:
        # Flash kernels need one head dim for q, k and v; a value head that differs (DeepSeek's
        # multi-head latent attention: 192 for q/k, 128 for v) runs the memory-efficient kernel on CUDA,
        # which saves the same q, k, v, out and log-sum-exp.
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, dropout_p, is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]


def _param_ids(params: Iterator[torch.Tensor]) -> set[int]:
    return {id(p) for p in params}


@contextmanager
def record(trace: Trace, state: _State, param_ids: set[int]) -> Iterator[None]:
    """Record ops and saved tensors of everything run inside (forward and backward alike)."""
    saved_ids: set[int] = set()  # the roots saved, each counted once (module docstring)
    keep: list[torch.Tensor] = []  # keeps saved tensors alive so ids stay unique while recording
    saved_at: list[tuple[int, int]] = []  # (index in trace.saved, id of the root it saves)

    def pack(t: torch.Tensor) -> torch.Tensor:
        root = t._base if t._base is not None else t
        if id(t) in param_ids or id(root) in param_ids:
            return t
        # A saved view keeps its whole storage alive, and two views of one storage hold it once: a
        # bias expanded over the batch (T5's position bias into SDPA) is one (heads, s, s) tensor,
        # not batch x that; one slice of a fused projection's output keeps all of it
        if id(root) not in saved_ids:
            saved_ids.add(id(root))
            keep.append(root)
            saved_at.append((len(trace.saved), id(root)))
            trace.saved.append(SavedRecord(region=state.region, nbytes=float(_storage_nbytes(root)),
                                           attention_bias=root in ATTENTION_BIASES))
        return t

    recorder = _Recorder(trace, state)
    with _CudaLikeFunctions(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        yield
    recorder.apply_fusion({recorder._rid_of(i) for i in saved_ids})
    # A saved tensor is packed before the GEMM that reads it runs: marked once the trace is whole.
    tensors = {id(t): t for t in keep}
    for i, root in saved_at:
        rid = recorder._rid_of(root)
        trace.saved[i] = dataclasses.replace(trace.saved[i], gemm_input=rid in recorder.gemm_inputs, root=rid,
                                             autocast_factor=recorder.autocast.factor(rid, tensors[root]))


def run_and_trace(
    fn: Callable[[Callable[[str], None]], Any],
    params: Iterator[torch.Tensor],
    trace: Trace | None = None,
) -> Trace:
    """Run ``fn(set_region)`` (which must do forward and backward) and return its trace.

    ``fn`` calls ``set_region(name)`` to attribute what follows to ``name``, and
    ``set_region("bwd:<name>")`` to switch to the backward phase. Pass ``trace`` to record into
    an existing Trace (hooks that add collectives to it need it before the run ends).
    """
    trace, state = (trace if trace is not None else Trace()), _State()

    def set_region(name: str) -> None:
        if name.startswith("bwd:"):
            state.phase, state.region = "bwd", name[4:]
        else:
            state.region = name

    with record(trace, state, _param_ids(params)):
        fn(set_region)
    return trace
