"""Time and measure each region (pre, one block, post, loss) of a model file on the local device.

The model is built on meta, cut to its first block (``one_block_model``: blocks repeat, one
stands for all), materialised on the device with freshly initialised weights and run forward +
backward. Region boundaries are the same as the meta trace's (autopar.graph.build.trace_model):
module hooks on the block in forward, gradient hooks on the block's input/output and on the
model output in backward; each boundary reads a clock (after ``torch.cuda.synchronize`` on GPU).
After ``warmup`` runs, the median over ``repeats`` runs is recorded per region and phase, and
for the block the forward of its attention core alone (``core_fwd_s``, hooks on the module the
executor's selective recompute checkpoints): the recompute cost, measured rather than apportioned.

Shapes: micro-batch ``b``, tokens per sample ``s`` (the model's SEQ_LEN and the CP-sharded
lengths SEQ_LEN / cp) and tensor-parallel degree ``tp``: the model as one tp rank of the executor
holds it (``shard_for_tp``) -- the block's Linear layers sharded by the tp_plan, the token
embedding vocab/tp rows and the output head vocab/tp output columns (executor/parallel/tensor_parallel.py;
a vocabulary tp does not divide stays whole, as the executor keeps it replicated). Token ids are
wrapped into the rank's vocab/tp rows. So at tp > 1 ``pre`` is the rank's embedding lookup,
``post`` the final norm plus its slice of the logits, and ``loss`` the model file's loss_fn on that
slice: the work a rank does under ``loss_parallel()``, whose per-token all-reduces (max, sum of
exponentials, target logit) and the head's input-gradient all-reduce are the cost model's, from
measured collectives (``profile --comm``). Every region gets a point per tp (``edges_replicated:
false``). Tables written before this measured the edges whole at tp = 1 only
(``edges_replicated: true``); the cost model still prices those edges as replicated.

Context parallelism: for each cp > 1 and each kind of ``cp_kinds``, the block is measured again at
SEQ_LEN / cp tokens with its attention core replaced by the executor's own
``ContextParallelAttention`` (cp rank 0) whose collectives return local data (``_loopback``): the
table then holds what a cp rank computes -- for ring attention cp block steps of s/cp queries
against s/cp keys with masks and log-sum-exp merges, for all-gather s/cp queries against s keys,
for Ulysses full-sequence attention on heads/cp -- not ordinary attention over s/cp tokens. The
transfers themselves are the cost model's (measured collective fits). Points carry ``cp`` and
``cp_kind``; only the block has them (the edges of a cp rank are the plain s/cp ones).

Clock: wall time after a device sync on GPU. On CPU with one thread per rank, the profiling
thread's CPU time times max(1, ranks / cores) (``ranks_per_machine``, ``--load-ranks``): beyond the
cores each single-threaded rank gets that share of a core, and CPU time, unlike wall time, does
not depend on when the scheduler happened to switch, nor on other work of a shared machine (the
helpers' cache and memory-bandwidth contention stays in it: stalled cycles are the thread's). A
profile taken at load average 5-7 on 2 cores predicted the zoo decoder's dp2 steps 14-35 % above
what validate measured minutes later, with wall time. CPU with several threads per rank: wall time
(the calling thread's CPU time would miss its workers') unless ranks exceed the cores.

Empty edges: blocks that take the model's raw input (no module before them) leave ``pre`` empty,
blocks whose last output is the model's output (no module after them) leave ``post`` empty; the
table still holds both regions, as the meta trace's graph does, at 0 s and 0 bytes (``_one_run``).

Memory: ``LiveBytes`` (allocator-level, see autopar.profiler.memory) -- ``saved_bytes`` is what
a region's forward leaves allocated for backward (for the block: its activations per micro-batch);
``peak_bytes`` the peak of live bytes over the whole one-block forward+backward.

Precision: a 16-bit profile runs the one-block model cast to that dtype (floating inputs too), as
FSDP2's mixed-precision policy runs the executor's parts and as the meta trace measures -- not under
autocast, whose per-forward copy of every Linear weight would be counted as the block's
activations (2 bytes per block parameter per micro-batch; about 70 % too much on a Llama-7B block
at 4k tokens). The cost model adds those copies itself where the executor trains under autocast
(cost/stage.py ``keeps_autocast_copies``).
"""

from __future__ import annotations

import statistics
import time
import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from autopar.graph.build import first_tensor as _first_tensor
from autopar.graph.build import one_block_model, sequence_keep, slice_sequence
from autopar.modelfile import ModelFile, backward, call_model
from autopar.profile_tables import LayerPoint, LayerTable
from autopar.profiler.cores import usable_cores
from autopar.profiler.memory import LiveBytes
from autopar.spec import find_core as _find_core  # the executor's own rule for the attention core
from autopar.spec import model_spec
from autopar.spec.tp_shard import Edges, shard_for_tp, vocab_size_of
from autopar.torch_dtypes import TORCH_DTYPES


@dataclass(frozen=True, kw_only=True)
class LayerProfileConfig:
    """What to measure. ``seq_lens`` default: the model's SEQ_LEN divided by each of ``cp``."""

    micro_batches: tuple[int, ...] = (1, 2, 4)
    tps: tuple[int, ...] = (1, 2)
    cps: tuple[int, ...] = (1, 2)
    cp_kinds: tuple[str, ...] = ("ring", "allgather", "ulysses")  # cp > 1: the block as a cp rank runs it
    dtype: str = "fp32"
    ranks_per_machine: int = 1  # CPU: the ranks sharing this machine's cores (times scale by max(1, ranks/cores))
    warmup: int = 2
    repeats: int = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_block_meta(mf: ModelFile) -> nn.Module:
    """The model file's model cut to its first block, on meta (``one_block_model``): what the layer
    table, the contention reference and the optimizer figure are measured on."""
    meta = mf.build("meta")
    return block_model(mf, meta, model_spec(mf, meta).blocks_path)


def block_model(mf: ModelFile, meta: nn.Module, blocks_attr: str | None) -> nn.Module:
    """``meta`` cut to the first block of ``blocks_attr`` -- or whole where the cut model does not run:
    a forward whose later units read what the cut units produced (a U-Net's decoder pops the skip
    connections its encoder blocks pushed) needs them all; its block is still the first one."""
    if blocks_attr is None:
        return meta
    small = one_block_model(meta, blocks_attr)
    if model_spec(mf, meta).blocks_kind != "chain":
        return small  # repeated blocks map their input to an output of its shape: the cut runs
    from autopar.spec.meta import tolerant_meta

    try:
        with tolerant_meta(), torch.no_grad():
            inputs = mf.example_inputs(1, "meta")
            out = call_model(small, inputs)
            if mf.loss_fn is not None:
                mf.loss_fn(out, inputs)
    except Exception:  # noqa: BLE001 - the user's forward on the cut model: the whole model runs instead
        return meta
    return small


def materialise(model: nn.Module, device: torch.device,
                buffers: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """A meta model on ``device`` with fresh weights (each module's own ``reset_parameters``) and
    its buffers' values from ``buffers`` (``ModelFile.buffer_values``, by name, where the shape
    matches); a buffer without one is zero if floating (its integer storage is left as allocated)."""
    model = model.to_empty(device=device)
    torch.manual_seed(0)
    values = buffers or {}
    with torch.no_grad():
        for mod in model.modules():
            reset = getattr(mod, "reset_parameters", None)
            if callable(reset):
                reset()
        for name, buf in model.named_buffers():
            value = values.get(name)
            if value is not None and value.shape == buf.shape:
                buf.copy_(value.to(device=buf.device, dtype=buf.dtype))
            elif buf.is_floating_point():
                buf.zero_()
    return model


def _rank_model(small: nn.Module, blocks_attr: str, tp_plan: dict[str, str], tp: int,
                local_attrs: tuple[str, ...] = (), edges: Edges | None = None) -> tuple[nn.Module, int | None]:
    """(``small`` as one tp rank holds it, the vocabulary rows of its embedding that token ids must
    stay below; None: the ids need no wrapping -- tp = 1, or no vocabulary)."""
    if tp == 1:
        return small, None
    vocab = vocab_size_of(small, edges)
    rows = vocab // tp if vocab is not None and vocab % tp == 0 else vocab  # the executor's rule
    # vocab_constants: a model's own label loss (HF: logits viewed by config.vocab_size) runs on the
    # rank's vocabulary slice, as the executor's vocab-parallel loss runs it on the DTensor logits.
    sharded = shard_for_tp(small, blocks_attr, tp_plan, tp, local_attrs, vocab_constants=True, edges=edges)
    if rows is not None:
        # ids left whole (_clamp_tokens: beside labels) are wrapped where the rank's table is read
        for mod in sharded.modules():
            if isinstance(mod, nn.Embedding) and mod.num_embeddings == rows:
                mod.register_forward_pre_hook(lambda m, args: (args[0].remainder(m.num_embeddings), *args[1:]))
    return sharded, rows


def _clamp_tokens(inputs: Any, high: int | None) -> Any:
    """Integer inputs (token ids) wrapped into [0, high): a smaller vocabulary must not be overrun. A
    batch with ``labels`` has only those wrapped: its ids reach the model as they are (the rank's
    embedding wraps what it looks up), so code that reads them -- LLaVA counts its image tokens,
    ids at the top of the vocabulary -- sees the real ones, as on a tp rank."""
    if high is None:
        return inputs

    def wrap(v: Any) -> Any:
        return v.remainder(high) if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool else v

    if isinstance(inputs, dict) and "labels" in inputs:
        return {k: tree_map(wrap, v) if k == "labels" else v for k, v in inputs.items()}
    return tree_map(wrap, inputs)


_CPU_SHARE = [0.0]  # > 0: CPU time x this (max(1, ranks / cores)); 0: wall time. Set by profile_layers


class _Clock:
    """Timestamps of region boundaries in one forward+backward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        _sync(self.device)
        # CPU with more single-threaded ranks than cores: this thread's CPU time times ranks/cores
        # (each rank's fair share of a core). Wall time under load samples the scheduler instead
        # (a ~10 ms region measured 3-15 ms at 4 ranks on 2 cores); CPU time does not.
        share = _CPU_SHARE[0]
        self.marks[name] = time.thread_time() * share if share > 0 and self.device.type == "cpu" else time.perf_counter()


def _one_run(model: nn.Module, block: nn.Module, inputs: Any, loss_fn: Callable | None, device: torch.device,
             live: LiveBytes | None) -> tuple[dict[str, float], dict[str, float]]:
    """One forward+backward; (seconds per region/phase, saved bytes per region). With an attention
    core in ``block`` (the executor's rule), also ``block.core_fwd``: the core's forward alone.

    Boundaries that fall on one tensor are marked in the regions' order, so no region is negative,
    and an empty edge region is 0 in both phases, as the meta trace finds it empty (no ops):
    ``pre`` when every tensor the block takes is one of ``inputs`` (nothing runs before it),
    ``post`` when every tensor of the model's output is one of the block's outputs (nothing runs
    after it). A block input that needs no gradient leaves no backward to ``pre``."""
    clock = _Clock(device)
    saved: dict[str, float] = {}
    at: dict[str, float] = {}
    input_ids = {id(t) for t in _tensors(inputs)}  # ``inputs`` outlives the run: the ids stay its tensors'
    seen: dict[str, Any] = {"pre_empty": False, "block_out": []}

    def note(name: str) -> None:
        clock.mark(name)
        if live is not None:
            at[name] = live.live_bytes

    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        note("block_in")
        given = _tensors((args, kwargs))
        seen["pre_empty"] = bool(given) and all(id(t) in input_ids for t in given)
        x = _first_tensor((args, kwargs))
        # An input that needs no gradient (the model's own input, or anything computed from it
        # without parameters) gets no hook: the block's backward then runs to the end of backward.
        if x is not None and x.requires_grad:
            x.register_hook(lambda g: note("bwd_block_end"))

    def post_hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        note("block_out")
        seen["block_out"] = [weakref.ref(t) for t in _tensors(out)]  # weak: the run's memory is the model's
        y = _first_tensor(out)
        if y is not None and y.requires_grad:
            y.register_hook(lambda g: note("bwd_post_end"))

    handles = [block.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True),
               block.register_forward_hook(post_hook, with_kwargs=True)]
    core_name = _find_core(block)
    if core_name is not None:  # looked up per run: under cp the core is the executor's cp attention
        core = block.get_submodule(core_name)
        handles += [core.register_forward_pre_hook(lambda mod, args: note("core_in"), prepend=True),
                    core.register_forward_hook(lambda mod, args, out: note("core_out"))]
    try:
        note("start")
        out = call_model(model, inputs)
        note("loss_start")
        block_out = [t for t in (r() for r in seen["block_out"]) if t is not None]
        y = _first_tensor(out)
        outs = _tensors(out)
        post_empty = bool(outs) and all(any(t is b for b in block_out) for t in outs)
        # The output's first tensor is the block's: its gradient reaches both at one instant. The
        # block's hook on that tensor, registered in forward, fires before any registered here, so
        # a second hook would mark the end of the loss's backward after the start of the block's
        # (a negative post region): the block's hook marks both ends instead.
        same_grad = y is not None and bool(block_out) and block_out[0] is y
        del block_out, outs
        loss = loss_fn(out, inputs) if loss_fn is not None else y.float().mean()
        if y is not None and y.requires_grad and not same_grad:
            y.register_hook(lambda g: note("bwd_loss_end"))
        note("loss_end")
        backward(loss)
        note("end")
    finally:
        for h in handles:
            h.remove()
    m = clock.marks
    if same_grad and "bwd_post_end" in m:
        m["bwd_loss_end"] = m["bwd_post_end"]
    m.setdefault("bwd_block_end", m["end"])  # no gradient into the block: nothing of backward after it
    # An empty edge: its two boundaries are one instant (the call into / return from the model is
    # not work of the region), so it is 0, not the few microseconds between the marks.
    if seen["pre_empty"]:
        m["start"] = m["block_in"]
        at["start"] = at.get("block_in", 0.0)
    if post_empty:
        m["loss_start"] = m["block_out"]
        at["loss_start"] = at.get("block_out", 0.0)
    times = {
        "pre.fwd": m["block_in"] - m["start"], "block.fwd": m["block_out"] - m["block_in"],
        "post.fwd": m["loss_start"] - m["block_out"], "loss.fwd": m["loss_end"] - m["loss_start"],
        "loss.bwd": m["bwd_loss_end"] - m["loss_end"], "post.bwd": m["bwd_post_end"] - m["bwd_loss_end"],
        "block.bwd": m["bwd_block_end"] - m["bwd_post_end"], "pre.bwd": m["end"] - m["bwd_block_end"],
    }
    if "core_out" in m:
        times["block.core_fwd"] = m["core_out"] - m["core_in"]
    if live is not None:
        saved = {"pre": at["block_in"] - at["start"], "block": at["block_out"] - at["block_in"],
                 "post": at["loss_start"] - at["block_out"], "loss": at["loss_end"] - at["loss_start"]}
    model.zero_grad(set_to_none=True)
    return times, saved


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple/list/dict of inputs, forward arguments or outputs."""
    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]


def profile_layers(mf: ModelFile, device: torch.device, cfg: LayerProfileConfig,
                   log: Callable[[str], None] | None = None) -> LayerTable:
    """Measure every region of ``mf`` at every (b, s, tp) of ``cfg`` as one tp rank runs it (see the
    module docstring)."""

    share = max(1.0, cfg.ranks_per_machine / usable_cores())
    # One thread per rank: its CPU time, which holds the cache and memory-bandwidth contention of
    # the helpers but not the waits for other work of a shared machine. Several threads: the
    # calling thread's CPU time misses its workers', so wall time (unless time-sharing cores).
    single = torch.get_num_threads() == 1
    _CPU_SHARE[0] = share if device.type == "cpu" and (single or share > 1.0) else 0.0
    meta = mf.build("meta")
    spec = model_spec(mf, meta)
    blocks_attr, tp_plan = spec.blocks_path, dict(spec.tp_plan or {})
    small = block_model(mf, meta, blocks_attr)
    buffers = mf.buffer_values()
    seq = mf.seq_len or 0
    seqs = sorted({seq // cp for cp in cfg.cps if seq and seq % cp == 0 and seq // cp >= 1}, reverse=True) or [seq]
    dtype = TORCH_DTYPES[cfg.dtype]  # 16 bits: the model and its floating inputs are cast (module docstring)
    regions: dict[str, list[LayerPoint]] = {r: [] for r in ("pre", "block", "post", "loss")}
    cp_runs = [(cp, kind) for cp in cfg.cps if cp > 1 and seq and seq % cp == 0 for kind in cfg.cp_kinds]
    cp_seqs = [(cp, seq // cp) for cp, _ in cp_runs]
    keep: frozenset[tuple[int, int]] | None = None  # the input dimensions of SEQ_LEN's size that are not the sequence
    for tp in cfg.tps:
        if tp > 1 and not tp_plan:
            continue
        rank_model, vocab = _rank_model(small, blocks_attr, tp_plan, tp, spec.tp.local_attrs,
                                        (spec.vocab_embedding, spec.vocab_head))
        with mf.running(f"while building the block at tp {tp} on {device}"):  # its reset_parameters
            model = materialise(rank_model, device, buffers)
        if dtype != torch.float32:
            model = model.to(dtype)
        model.train()
        block = model.get_submodule(blocks_attr)[0]
        shapes = [(s, b) for s in seqs for b in cfg.micro_batches]
        rank_loss = _RankLoss(mf.loss_fn, tp, vocab) if mf.loss_fn is not None else None
        if keep is None:
            keep = _sequence_keep(mf, model, tp, device, seq, min(seqs + [s for _, s in cp_seqs]), vocab, dtype)
        # A failure of the model names the shape it was run at: one line, exit 2 (ModelFile.running).
        at = [f"micro-batch {b}{f', {s} tokens' if s != seq else ''}, tp {tp} on {device}" for s, b in shapes]
        measured = _measure(rank_loss, model, block, [_inputs(mf, b, device, seq, s, vocab, dtype, keep) for s, b in shapes],
                            device, cfg, guard=lambda j, doing: mf.running(f"while {doing} the block at {at[j]}"))
        for (s, b), (med, saved, peak) in zip(shapes, measured):
            for region in regions:  # at tp > 1 the edges too are this tp rank's vocabulary shard
                regions[region].append(LayerPoint(
                    b=b, s=s if seq else 1, tp=tp, fwd_s=med[f"{region}.fwd"], bwd_s=med[f"{region}.bwd"],
                    saved_bytes=float(max(0.0, saved[region])), peak_bytes=peak,
                    core_fwd_s=med.get("block.core_fwd") if region == "block" else None))
            if log:
                log(f"b={b} s={s} tp={tp}: block fwd {med['block.fwd'] * 1e3:.2f} ms bwd "
                    f"{med['block.bwd'] * 1e3:.2f} ms, saved {saved['block'] / 2**20:.1f} MiB")
        core_name = _find_core(block)
        for cp, kind in cp_runs if core_name else []:
            s = seq // cp
            # the RuntimeErrors of a cp kind the block cannot take are logged below, as before; any
            # other failure of the model is one line
            with mf.running(f"while timing the block at {s} tokens, tp {tp}, cp {cp} ({kind}) on {device}"), \
                    _cp_core(block, core_name, kind, cp, seq):
                try:
                    measured = _measure(rank_loss, model, block,
                                        [_inputs(mf, b, device, seq, s, vocab, dtype, keep) for b in cfg.micro_batches],
                                        device, cfg)
                except RuntimeError as exc:  # e.g. ulysses with heads not divisible by cp
                    if log:
                        log(f"s={s} tp={tp} cp={cp} {kind}: not measured ({str(exc).splitlines()[0]})")
                    continue
            for b, (med, saved, peak) in zip(cfg.micro_batches, measured):
                regions["block"].append(LayerPoint(
                    b=b, s=s, tp=tp, cp=cp, cp_kind=kind, fwd_s=med["block.fwd"], bwd_s=med["block.bwd"],
                    saved_bytes=float(max(0.0, saved["block"])), peak_bytes=peak,
                    core_fwd_s=med.get("block.core_fwd")))
                if log:
                    log(f"b={b} s={s} tp={tp} cp={cp} {kind}: block fwd {med['block.fwd'] * 1e3:.2f} ms bwd "
                        f"{med['block.bwd'] * 1e3:.2f} ms, saved {saved['block'] / 2**20:.1f} MiB")
        if log and rank_loss is not None and rank_loss.note:
            log(rank_loss.note)
        del model
    return LayerTable(model_name=mf.name, model_sha256=mf.sha256, dtype=cfg.dtype, seq_len=seq or 1,
                      edges_replicated=False, regions={r: tuple(p) for r, p in regions.items() if p})


def _inputs(mf: ModelFile, b: int, device: torch.device, seq: int, s: int, vocab: int | None,
            dtype: torch.dtype = torch.float32, keep: frozenset[tuple[int, int]] | None = None) -> Any:
    inputs = mf.example_inputs(b, device)
    if seq and s != seq:
        inputs = slice_sequence(inputs, seq, s, keep or frozenset())
    if dtype != torch.float32:  # as FSDP2's cast_forward_inputs: floating inputs in the model's dtype
        inputs = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)
    return _clamp_tokens(inputs, vocab)


def _sequence_keep(mf: ModelFile, model: nn.Module, tp: int, device: torch.device, seq: int, s: int,
                   vocab: int | None, dtype: torch.dtype) -> frozenset[tuple[int, int]]:
    """The dimensions of the inputs that have SEQ_LEN's size but are not the sequence (a channel
    count equal to SEQ_LEN: 16 mel bins at SEQ_LEN 16), found as the planner finds them
    (graph.build.sequence_keep): by whether the model runs on its inputs cut to ``s`` tokens. Empty
    when every such dimension is cut, or when no shorter sequence is timed."""
    if not seq or s >= seq:
        return frozenset()
    full = _inputs(mf, 1, device, seq, seq, vocab, dtype)

    def runs(inputs: Any) -> bool:
        try:
            with torch.no_grad():
                out = call_model(model, inputs)
                if mf.loss_fn is not None:  # a loss of its own: the one below decides nothing for the timed runs
                    _RankLoss(mf.loss_fn, tp, vocab)(out, inputs)
        except Exception:  # noqa: BLE001 - the user's model on inputs cut where it does not take a cut
            return False
        return True

    if runs(slice_sequence(full, seq, s)):
        return frozenset()
    return sequence_keep(full, seq, s, runs)


class _RankLoss:
    """The model file's loss as one tp rank of the executor runs it (executor/parallel/tensor_parallel.py):
    on the rank's vocabulary slice of the logits, or, for a loss_fn that cannot take a slice (it
    reshapes by the whole vocabulary, or gathers by token id), on the whole logits, which the
    executor then all-gathers first. The slice repeated tp times stands for the gathered logits: the
    same shape, so the same work. ``note`` says when the whole logits were used.

    An output that is not one tensor (a Hugging Face ``ModelOutput``, a dict, a tuple) has every
    floating tensor whose last dimension is the rank's ``rows`` of the vocabulary widened so, as the
    executor gathers every DTensor of the output; None: ``rows`` unknown, only a lone tensor widens."""

    def __init__(self, loss_fn: Callable, tp: int, rows: int | None = None) -> None:
        self.loss_fn, self.tp, self.rows = loss_fn, tp, rows
        self.note: str | None = None

    def _whole(self, out: Any) -> Any:
        """``out`` with its vocabulary slices repeated tp times, or None when it holds none."""
        if isinstance(out, torch.Tensor):
            return torch.cat([out] * self.tp, dim=-1)
        found = []

        def widen(v: Any) -> Any:
            if (isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2 and self.rows
                    and v.shape[-1] == self.rows):
                found.append(v)
                return torch.cat([v] * self.tp, dim=-1)
            return v

        whole = tree_map(widen, out)
        return whole if found else None

    def __call__(self, out: Any, inputs: Any) -> torch.Tensor:
        if self.note is None:
            try:
                return self.loss_fn(out, inputs)
            except Exception as exc:  # noqa: BLE001 - the user's loss on a slice it was not written for
                whole = self._whole(out) if self.tp > 1 else None
                if whole is None:
                    raise
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
                self.note = (f"tp={self.tp}: loss_fn does not run on one rank's vocabulary slice ({type(exc).__name__}: "
                             f"{first}); its loss is timed on the whole logits, as the executor gathers them")
                return self.loss_fn(whole, inputs)
        return self.loss_fn(self._whole(out), inputs)


def _no_guard(j: int, doing: str) -> AbstractContextManager[None]:
    return nullcontext()


def _measure(loss_fn: Callable | None, model: nn.Module, block: nn.Module, inputs: list[Any], device: torch.device,
             cfg: LayerProfileConfig, guard: Callable[[int, str], AbstractContextManager[None]] = _no_guard,
             ) -> list[tuple[dict[str, float], dict[str, float], float]]:
    """Per shape of ``inputs``: (median seconds per region/phase, saved bytes per region, peak live
    bytes). The shapes take turns, one run each per round, so that a slow spell of a shared machine
    falls on all of them alike instead of on whichever shape was being measured (a 4-rank profile
    measured micro-batch 4 ~17 % faster per sample than 2 and 8 when each was timed in one go).
    ``guard(j, doing)`` is entered around each run of shape j ("timing", "measuring the memory of")."""
    samples: list[dict[str, list[float]]] = [{} for _ in inputs]
    for i in range(cfg.warmup + cfg.repeats):
        for j, x in enumerate(inputs):
            with guard(j, "timing"):
                times, _ = _one_run(model, block, x, loss_fn, device, None)
            if i >= cfg.warmup:
                for k, v in times.items():
                    samples[j].setdefault(k, []).append(v)
    out = []
    for j, x in enumerate(inputs):
        live = LiveBytes()
        with guard(j, "measuring the memory of"), live:
            _, saved = _one_run(model, block, x, loss_fn, device, live)
        out.append(({k: statistics.median(v) for k, v in samples[j].items()}, saved, float(live.peak_bytes)))
    return out


@contextmanager
def _cp_core(block: nn.Module, core_name: str, kind: str, cp: int, seq_len: int) -> Iterator[None]:
    """``block`` with its attention core replaced by the executor's ``ContextParallelAttention`` of
    cp rank 0, its collectives on a loopback (``_loopback``): every op the executor's cp rank
    runs on the block -- ring steps, masks, log-sum-exp merges, the all-gathered K/V, Ulysses's
    head-sharded attention and re-layouts -- without the transfers (the cost model adds those)."""
    from autopar.executor.parallel.context_parallel import ContextParallelAttention

    parent_name, _, leaf = core_name.rpartition(".")
    parent = block.get_submodule(parent_name) if parent_name else block
    original = getattr(parent, leaf)
    setattr(parent, leaf, ContextParallelAttention(kind, None, cp, 0, seq_len))  # type: ignore[arg-type]
    try:
        with _loopback(cp):
            yield
    finally:
        setattr(parent, leaf, original)


@contextmanager
def _loopback(cp: int) -> Iterator[None]:
    """The executor's cp collectives on one process: a ring shift returns this rank's own block,
    an all-gather ``cp`` copies of it, an all-to-all its input -- same shapes, same local work."""
    import torch.distributed._functional_collectives as fc

    import autopar.executor.parallel.ring_attention as ra

    def send_recv(t: torch.Tensor, to: int, frm: int, group: Any) -> torch.Tensor:
        return t.clone()

    def all_gather(out: torch.Tensor, t: torch.Tensor, group: Any) -> None:
        out.copy_(t.unsqueeze(0).expand_as(out))

    def reduce_scatter(out: torch.Tensor, t: torch.Tensor, group: Any) -> None:
        out.copy_(t[0])

    def all_to_all(x: torch.Tensor, output_split_sizes: Any = None, input_split_sizes: Any = None,
                   group: Any = None) -> torch.Tensor:
        return x.clone()

    saved = ra.send_recv, ra.all_gather, ra.reduce_scatter, fc.all_to_all_single_autograd
    ra.send_recv, ra.all_gather, ra.reduce_scatter, fc.all_to_all_single_autograd = (
        send_recv, all_gather, reduce_scatter, all_to_all)
    try:
        yield
    finally:
        ra.send_recv, ra.all_gather, ra.reduce_scatter, fc.all_to_all_single_autograd = saved


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))
