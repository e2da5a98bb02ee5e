"""Trace a model file on the meta device at the shapes ``scaling`` needs.

The model is built on meta in the plan's dtype. To keep a 1,000-layer model as fast as a 2-layer
one, the repeated-block ModuleList is cut to its first block while tracing (blocks repeat: one is
measured and stands for all); when the model's forward cannot run that way the full model is traced.
Regions are switched by module hooks in forward and by tensor-gradient hooks in backward:

    forward:  pre -> block -> post -> loss        backward: loss -> post -> block -> pre
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.block_dict import BlockDict
from autopar.errors import ModelFileError
from autopar.graph.records import PeakRecord
from autopar.graph.trace import Trace, run_and_trace
from autopar.modelfile import call_model
from autopar.spec.meta import tolerant_meta
from autopar.spec.tp_plan import is_tp_linear
from autopar.spec.tp_shard import match_tp_style

REGIONS = ("pre", "block", "post", "loss")


def slice_sequence(inputs: Any, seq_len: int, new_len: int, keep: frozenset[tuple[int, int]] = frozenset()) -> Any:
    """Cut, in every tensor leaf, the first dimension of size ``seq_len`` that is not in ``keep``
    ((leaf index, dimension) pairs the model's flow showed are not the sequence: ``sequence_keep``)
    to ``new_len``."""
    leaves, spec = tree_flatten(inputs)
    out = []
    for i, v in enumerate(leaves):
        if isinstance(v, torch.Tensor):
            dim = next((d for d, n in enumerate(v.shape) if n == seq_len and (i, d) not in keep), None)
            if dim is not None:
                v = v.narrow(dim, 0, new_len)
        out.append(v)
    return tree_unflatten(out, spec)


def sequence_keep(inputs: Any, seq_len: int, new_len: int, runs: Callable[[Any], bool]) -> frozenset[tuple[int, int]]:
    """The dimensions of size ``seq_len`` that are not the sequence, found by how the model takes them
    (called once cutting every first such dimension failed): each candidate the model cannot take
    shortened -- it fails with that one cut and the others kept whole -- is kept whole, and the first
    set of kept dimensions with which the model runs is returned (empty: no choice runs). A channel
    count that happens to equal SEQ_LEN (16 mel bins at SEQ_LEN 16) is kept; the tensor's next
    dimension of that size, if any, is cut instead."""
    leaves = tree_flatten(inputs)[0]
    candidates = [(i, d) for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)
                  for d, n in enumerate(v.shape) if n == seq_len]
    keep: frozenset[tuple[int, int]] = frozenset()
    for cand in candidates:
        if runs(slice_sequence(inputs, seq_len, new_len, frozenset(candidates) - {cand})):
            continue  # the model takes this dimension shortened
        keep = keep | {cand}
        if runs(slice_sequence(inputs, seq_len, new_len, keep)):
            return keep
    return frozenset()


@dataclass(kw_only=True)
class TracedRun:
    trace: Trace
    param_regions: dict[int, set[str]]  # id(parameter) -> regions whose modules used it
    block_input_bytes: float  # bytes of the tensor entering the first block (what full recompute keeps)
    # bytes of the tensors the model returned (its logits: what torch pipelining's last stage holds
    # until the micro-batch's backward; the training loop without a pipeline drops them at the loss)
    output_bytes: float = 0.0
    # whether the block saves the very tensor it receives (its first norm or GEMM does): under a
    # pipeline that tensor is the receive buffer, priced with the buffers (ModelGraph.block_saves_input)
    block_saves_input: bool = False
    # whether it saves the very tensor it returns (a last ReLU saves its output): under a pipeline
    # that tensor is also the chunk's output torch pipelining keeps (ModelGraph.block_saves_output)
    block_saves_output: bool = False
    # a layer chain's trace: the same for each unit it ran, in order (graph/chain_measure.py)
    unit_saves_input: tuple[bool, ...] = ()
    unit_saves_output: tuple[bool, ...] = ()


def output_bytes(value: Any) -> float:
    """Bytes of the tensors in a (nested) model output, each storage once."""
    seen: dict[int, float] = {}

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            storage = v.untyped_storage()
            seen[id(storage)] = float(storage.nbytes())
        elif isinstance(v, Mapping):  # a ModelOutput pytree does not know
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    for leaf in tree_flatten(value)[0]:
        visit(leaf)
    return sum(seen.values())


def batch_input_bytes(mf: Any) -> float:
    """Bytes per sample of the model file's inputs as it makes them (``example_inputs``, dtypes
    uncast: an image batch in fp32, token ids in int64), each storage once: the executor moves a
    rank's rows of the step's batch to its device and slices micro-batches from them there
    (ModelGraph.batch_input_bytes). From two samples, so that a per-batch constant counts half."""
    return output_bytes(mf.example_inputs(2, "meta")) / 2.0


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (nested) tuple/list/dict of forward arguments or outputs."""
    return next((v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)), None)


def trace_model(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    block: nn.Module | None,
    tp_plan: Mapping[str, str] | None,
    blocks_attr: str | None,
) -> TracedRun:
    """One forward+backward of ``model`` on meta, attributed to pre / block / post / loss, and its
    memory timeline (``Trace.peaks``, graph/live.py) from a second, unrecorded run."""
    regions = ParamRegions(model)
    handles = regions.handles
    io: dict[str, float] = {"in": 0.0, "out": 0.0}

    def run(set_region_raw: Callable[[str], None]) -> None:
        set_region = regions.setter(set_region_raw)
        if block is not None:
            handles.extend(_region_hooks(block, set_region, io))
            if tp_plan:
                handles.extend(_tp_comm_hooks(block, tp_plan, blocks_attr or "", trace))
        forward_backward(model, inputs, loss_fn, set_region, io)

    trace = Trace()
    try:
        run_and_trace(run, model.parameters(), trace)
    finally:
        for h in handles:
            h.remove()
    trace.peaks = _peaks(model, inputs, loss_fn, block)
    saved_roots = {r.root for r in trace.saved if r.region == "block"}
    return TracedRun(trace=trace, param_regions=regions.by_param,
                     block_input_bytes=io["in"], output_bytes=io["out"],
                     block_saves_input=io.get("in_root") in saved_roots, block_saves_output=io.get("out_root") in saved_roots)


def _region_hooks(block: nn.Module, set_region: Callable[[str], None], io: dict[str, float]) -> list:
    """Hooks on the (first) block that switch the region: block on entry, post after it, and their
    backward counterparts when the gradient reaches the block's output and input."""
    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        set_region("block")
        x = first_tensor((args, kwargs))
        if x is not None:
            io["in"] = float(x.numel() * x.element_size())
            # the storage's root as the trace's saved records name it (alive through the block's forward)
            io["in_root"] = id(x._base if x._base is not None else x)
            if x.requires_grad:
                x.register_hook(lambda g: set_region("bwd:pre"))

    def post_hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        set_region("post")
        y = first_tensor(out)
        if y is not None:
            io["out_root"] = id(y._base if y._base is not None else y)
        if y is not None and y.requires_grad:
            y.register_hook(lambda g: set_region("bwd:block"))
            # A model whose output is this very tensor has no post region: its backward must not
            # open after the block's (_forward_backward reads the mark; tensor hooks run in order)
            y._autopar_block_output = True

    return [block.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True),
            block.register_forward_hook(post_hook, with_kwargs=True)]


def forward_backward(model: nn.Module, inputs: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                     set_region: Callable[[str], None], io: dict[str, float] | None = None) -> None:
    """The model file's forward, loss and backward, as the training loop runs them (the output is
    not held once the loss has it); ``io["out"]``: set to the output's bytes."""
    set_region("pre")
    with tolerant_meta():  # value reads of meta tensors (HF's .item() checks) get a default
        out = call_model(model, inputs)
    if io is not None:
        io["out"] = output_bytes(out)
    set_region("loss")
    loss = loss_fn(out, inputs) if loss_fn is not None else default_loss(out)
    y = first_tensor(out)
    if y is not None and y.requires_grad and not getattr(y, "_autopar_block_output", False):
        y.register_hook(lambda g: set_region("bwd:post"))
    del out, y
    set_region("bwd:loss")
    loss.backward()


def _peaks(model: nn.Module, inputs: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
           block: nn.Module | None) -> list[PeakRecord]:
    """The step's memory timeline (graph/live.py) as one record per (region, phase)."""
    handles: list = []

    def step(set_region: Callable[[str], None]) -> None:
        if block is not None:
            handles.extend(_region_hooks(block, set_region, {}))
        forward_backward(model, inputs, loss_fn, set_region)

    return peak_records(step, list(model.parameters()), handles)


def peak_records(step: Callable[[Callable[[str], None]], Any], params: list[torch.Tensor], handles: list
                 ) -> list[PeakRecord]:
    """``live_peaks(step, params)`` (graph/live.py) as one record per (region, phase); the hooks
    ``step`` put in ``handles`` are removed after, whatever happens."""
    from autopar.graph.live import live_peaks

    try:
        live = live_peaks(step, params)
    finally:
        for h in handles:
            h.remove()
    none = (0.0, 0.0, 0.0)
    records = []
    for (phase, region), v in live.temps.items():
        temps, _, credit = live.credited.get((phase, region), none)
        g_temps, grads, g_credit = live.with_grads.get((phase, region), none)
        rise_temps, to_come = live.rises.get((phase, region), (0.0, 0.0))
        records.append(PeakRecord(region=region, phase=phase, nbytes=max(0.0, float(v)),
                                  rise_temps_nbytes=max(0.0, rise_temps), rise_to_come_nbytes=to_come,
                                  credit_temps_nbytes=max(0.0, temps), credit_nbytes=credit,
                                  grads_temps_nbytes=max(0.0, g_temps), grads_nbytes=grads, grads_credit_nbytes=g_credit,
                                  grads_states=live.grads_states.get((phase, region), ())))
    return records


class ParamRegions:
    """Which regions' modules use each parameter during one traced forward: a forward pre-hook on
    every module of ``model`` notes the region the forward is in when the module runs. ``setter``
    wraps the tracer's region switch so that forward regions move ``current`` (backward ones,
    ``bwd:*``, leave it). ``handles`` are the hooks to remove after the trace (callers add theirs).

    A module whose parent reads its weights without calling it (``nn.MultiheadAttention`` hands
    ``out_proj.weight`` to its functional forward) never runs: ``by_param`` gives its parameters
    the regions of the nearest ancestor that ran (``_complete``, once the trace is over)."""

    def __init__(self, model: nn.Module) -> None:
        self.current = "pre"
        self._model = model
        self._noted: dict[int, set[str]] = {}  # id(parameter) -> regions whose modules used it
        self._ran: dict[int, set[str]] = {}  # id(module) -> regions it ran in
        self.handles: list = [mod.register_forward_pre_hook(self._note) for mod in model.modules()]

    def _note(self, mod: nn.Module, args: tuple) -> None:
        self._ran.setdefault(id(mod), set()).add(self.current)
        for p in mod.parameters(recurse=False):
            self._noted.setdefault(id(p), set()).add(self.current)

    @property
    def by_param(self) -> dict[int, set[str]]:
        """id(parameter) -> the regions whose modules used it (module docstring)."""
        return self._complete()

    def _complete(self) -> dict[int, set[str]]:
        out = {k: set(v) for k, v in self._noted.items()}

        def walk(mod: nn.Module, inherited: set[str] | None) -> None:
            regions = self._ran.get(id(mod), inherited)
            for p in mod.parameters(recurse=False):
                if id(p) not in out and regions:
                    out[id(p)] = set(regions)
            for child in mod.children():
                walk(child, regions)

        walk(self._model, None)
        return out

    def setter(self, set_region_raw: Callable[[str], None]) -> Callable[[str], None]:
        def set_region(name: str) -> None:
            if not name.startswith("bwd:"):
                self.current = name
            set_region_raw(name)

        return set_region


def default_loss(out: Any) -> torch.Tensor:
    """The loss of a model file without ``loss_fn``: the mean of its output's first tensor."""
    y = first_tensor(out)
    if y is None:
        raise ModelFileError("the model's output holds no tensor to train on; define loss_fn(output, inputs)")
    return y.float().mean()


def _tp_comm_hooks(block: nn.Module, tp_plan: Mapping[str, str], blocks_attr: str, trace: Trace) -> list:
    """Record the tensor-parallel collectives a block needs (whatever tp is, their size is the same):
    forward, one all-reduce of each rowwise Linear's output; backward, one all-reduce of the gradient
    of each distinct colwise input (q, k, v reading one input need one)."""
    handles = []
    colwise_inputs: set[int] = set()

    def on_rowwise(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        trace.comm.append(("block", "fwd", "tp_allreduce", float(out.numel() * out.element_size())))

    def on_colwise(mod: nn.Module, args: tuple) -> None:
        x = args[0]
        if id(x) not in colwise_inputs:
            colwise_inputs.add(id(x))
            trace.comm.append(("block", "bwd", "tp_allreduce", float(x.numel() * x.element_size())))

    for name, mod in block.named_modules():
        style = match_tp_style(name, tp_plan, blocks_attr) if name else None
        if is_tp_linear(mod) and style == "rowwise":
            handles.append(mod.register_forward_hook(on_rowwise))
        elif is_tp_linear(mod) and style == "colwise":
            handles.append(mod.register_forward_pre_hook(on_colwise))
    return handles


def one_block_model(model: nn.Module, blocks_attr: str) -> nn.Module:
    """A shallow copy of ``model`` whose block list holds only its first block (shared, not copied)."""
    clone = copy.copy(model)
    clone._modules = dict(model._modules)  # type: ignore[attr-defined]
    parent_name, _, leaf = blocks_attr.rpartition(".")
    blocks = model.get_submodule(blocks_attr)
    if parent_name:
        parent = copy.copy(clone.get_submodule(parent_name))
        parent._modules = dict(parent._modules)  # type: ignore[attr-defined]
        _set_path(clone, parent_name, parent)
        parent._modules[leaf] = _one(blocks)
    else:
        clone._modules[leaf] = _one(blocks)
    return clone


def _one(blocks: nn.Module) -> nn.Module:
    """The block list cut to its first block, of the same container kind (a Sequential is called,
    a ModuleList is iterated, a numbered ModuleDict answers a dict's calls)."""
    if isinstance(blocks, BlockDict):
        return BlockDict({"0": blocks[0]})
    return nn.Sequential(blocks[0]) if isinstance(blocks, nn.Sequential) else nn.ModuleList([blocks[0]])


def _set_path(root: nn.Module, path: str, value: nn.Module) -> None:
    parts = path.split(".")
    mod = root
    for i, p in enumerate(parts[:-1]):
        child = copy.copy(mod._modules[p])
        child._modules = dict(child._modules)
        mod._modules[p] = child
        mod = child
    mod._modules[parts[-1]] = value
