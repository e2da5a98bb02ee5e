"""Measure a model file on the meta device into a ``ModelGraph`` (needs torch; see model_graph.py)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autopar.errors import ModelFileError
from autopar.graph.build import batch_input_bytes, one_block_model, sequence_keep, slice_sequence, trace_model
from autopar.graph.carried import measure_carried
from autopar.graph.fused_scan import fit_with_scan
from autopar.graph.model_graph import ModelGraph, MoEFacts, RegionParams
from autopar.graph.scaling import FitQuantity, RegionFit, fit_output
from autopar.graph.short_probe import build_bounded
from autopar.graph.time_limit import active_clock, enter_stage, measure_time_limit
from autopar.modelfile import ModelFile, load_model_file
from autopar.spec import model_spec
from autopar.spec.tp_shard import Edges, shard_for_tp
from autopar.torch_dtypes import TORCH_DTYPES
from autopar.usercode import model_failed


def build_graph(model_file: ModelFile | str, *, seq_len: int | None = None, dtype: str = "bf16",
                time_limit_s: float | None = None, memo: bool = True) -> ModelGraph:
    """Measure ``model_file`` on meta and return its ModelGraph (cached in this process per file,
    seq_len, dtype; ``memo`` False: traced afresh -- the graph cache's miss, whose file may build
    another model from the same bytes, graph/build_inputs.py). Building, probing and tracing
    together end within ``time_limit_s`` seconds of CPU time (default: the AUTOPAR_TRACE_TIMEOUT_S
    environment variable, else 60; autopar.graph.time_limit) or raise a one-line ModelFileError."""
    mf = model_file if isinstance(model_file, ModelFile) else load_model_file(model_file)
    key = (str(mf.path.resolve()), mf.sha256, seq_len, dtype)
    if not memo or key not in _CACHE:
        with measure_time_limit(mf.path, time_limit_s):
            _CACHE[key] = build_bounded(mf, seq_len, dtype, _build)
    return _CACHE[key]


_CACHE: dict[tuple[str, str, int | None, str], ModelGraph] = {}


def _build(mf: ModelFile, seq_len: int | None, dtype: str) -> ModelGraph:
    start = time.perf_counter()
    torch_dtype = TORCH_DTYPES[dtype]
    model = mf.build("meta")
    enter_stage("probing")
    spec = model_spec(mf, model)  # probed as built, with the file's own example inputs
    enter_stage("tracing")
    model = model.to(torch_dtype)
    model.train()
    if spec.blocks_kind == "chain":
        from autopar.graph.chain_measure import build_chain_graph

        return build_chain_graph(mf, model, spec, seq_len, dtype, lambda b: _inputs(mf, b, torch_dtype), start)
    blocks_attr = spec.blocks_path
    num_blocks = spec.num_blocks
    tp_plan = spec.tp_plan
    heads, kv_heads = spec.num_heads, spec.num_kv_heads

    base_seq = seq_len or mf.seq_len
    if base_seq is not None and mf.seq_len is not None and base_seq > mf.seq_len:
        raise ModelFileError(
            f"{mf.path}: sequence length {base_seq} (--seq-len or the plan's training.seq_len) exceeds the "
            f"model file's SEQ_LEN {mf.seq_len}"
        )
    is_seq = base_seq is not None and base_seq >= 2 and base_seq % 2 == 0
    full1, full2 = _inputs(mf, 1, torch_dtype), _inputs(mf, 2, torch_dtype)
    small = one_block_model(model, blocks_attr)

    def run(m: nn.Module, inp: Any, loss_fn: Any = mf.loss_fn) -> Any:
        blk = m.get_submodule(blocks_attr)[0]
        try:
            return trace_model(m, inp, loss_fn, blk, tp_plan, blocks_attr)
        except ModelFileError as exc:
            raise ModelFileError(str(exc) if str(exc).startswith(str(mf.path)) else f"{mf.path}: {exc}") from None
        except Exception as exc:  # the user's forward or loss on meta
            clock = active_clock()
            if clock is not None and clock.expired:  # the time limit's interrupt, wrapped (autograd)
                raise clock.error(mf.path) from None
            raise model_failed(mf.path, "on the meta device", exc) from None

    def runs(inp: Any) -> bool:
        try:
            run(small, inp)
        except ModelFileError:
            return False
        return True

    def traces(keep: frozenset[tuple[int, int]]) -> tuple[tuple[Any, Any, Any], Any, Any, Any]:
        """(the inputs at base_seq, at twice the batch and at half the sequence (None: not a
        sequence model), and the traces at them), cutting the sequence everywhere but the
        dimensions in ``keep``."""
        def sized(full: Any) -> Any:
            if base_seq is not None and mf.seq_len is not None and base_seq != mf.seq_len:
                return slice_sequence(full, mf.seq_len, base_seq, keep)
            return full

        inp1, inp2 = sized(full1), sized(full2)
        inp_half = slice_sequence(inp1, base_seq, base_seq // 2, keep) if is_seq else None
        at_base, at_b2 = run(small, inp1), run(small, inp2)
        half = run(small, inp_half) if is_seq else None
        return (inp1, inp2, inp_half), at_base, at_b2, half

    try:
        shapes, base, b2, s_half = traces(frozenset())
    except ModelFileError:
        # a dimension of the sequence's size that is not the sequence (a channel count): found by
        # how the model takes the inputs shortened, not by the size alone (sequence_keep)
        seq0 = mf.seq_len or base_seq
        if seq0 is None or seq0 < 2:
            raise
        keep = sequence_keep(full1, seq0, base_seq if base_seq != seq0 else seq0 // 2, runs)
        if not keep:
            raise
        shapes, base, b2, s_half = traces(keep)
    inputs1 = shapes[0]
    tp_reason = spec.support_reason("tp")
    t2, loss_t2 = None, True
    if tp_reason is None:
        edges = (spec.vocab_embedding, spec.vocab_head)  # the edges the executor shards by vocabulary
        sharded = shard_for_tp(small, blocks_attr, tp_plan, 2, spec.tp.local_attrs, edges=edges)
        try:
            t2 = run(sharded, inputs1)
        except ModelFileError as exc:
            # A loss may hold the vocabulary as a constant: on meta it fails on the half-vocabulary
            # logits of this trace, while the executor hands it DTensor logits of the full global
            # shape, which run vocab-parallel. The model's own label loss (HF: labels in the inputs,
            # logits viewed by config.vocab_size) runs on the rank's slice once the model's vocabulary
            # attributes are divided too: the loss region keeps its vocab-parallel exponents. A
            # loss_fn's own constant (logits.view(-1, VOCAB)): trace again with the model's default
            # loss; the edges keep their vocab-parallel exponents, the loss region is fitted without
            # tp (measured at full vocabulary).
            local = shard_for_tp(small, blocks_attr, tp_plan, 2, spec.tp.local_attrs, vocab_constants=True,
                                 edges=edges)
            try:
                t2 = run(local, inputs1)
            except ModelFileError:
                try:
                    t2, loss_t2 = run(sharded, inputs1, None), False
                except ModelFileError:
                    tp_reason = f"the block does not run on tp-sharded Linear layers ({exc})"
    regions: dict[str, RegionFit] = {}
    for region in ("pre", "block", "post", "loss"):
        t2_region = t2.trace if t2 is not None and (loss_t2 or region != "loss") else None
        try:
            regions[region] = fit_with_scan(region, base.trace, b2.trace, s_half and s_half.trace, t2_region,
                                            base_seq if s_half else None)
        except ValueError:
            # Shapes change the op sequence: fall back to fitting without TP (rare; non-transformer code paths).
            regions[region] = fit_with_scan(region, base.trace, b2.trace, None, None)
    params, tied = _region_params(small, base.param_regions, t2, blocks_attr, tp_plan, spec.tp.local_attrs,
                                  (spec.vocab_embedding, spec.vocab_head))
    support = dict(spec.support)
    if tp_reason is not None:  # the sharded block did not trace: TP and what needs it are off
        support.update(tp=tp_reason, sp=support["sp"] or "needs tp")
    if not is_seq and support["cp"] is None:
        support["cp"] = f"sequence length {base_seq} cannot be split"
    cp_reason = support["cp"]
    return ModelGraph(
        name=mf.name, sha256=mf.sha256, num_blocks=num_blocks, seq_len=base_seq if is_seq else 1,
        is_sequence_model=is_seq, dtype=dtype, num_heads=heads, num_kv_heads=kv_heads,
        tp_reason=tp_reason, cp_reason=cp_reason, pp_reason=support["pp"], support=support,
        tp_source=spec.tp.describe(), tp_styles=dict(tp_plan or {}),
        regions=regions, params=params, tied_params=tied,
        block_input_bytes=base.block_input_bytes, block_saves_input=base.block_saves_input,
        block_saves_output=base.block_saves_output,
        batch_input_bytes=batch_input_bytes(mf) * (base_seq / mf.seq_len if is_seq and mf.seq_len else 1.0),
        build_seconds=time.perf_counter() - start, moe=MoEFacts.of(spec.moe),  # expert parallelism
        tp_degrees=spec.tp_degrees,
        carried=_carried(mf, small, spec, shapes) if support["pp"] is None else (),
        output=fit_output(base, b2, s_half, t2),
    )


def _carried(mf: ModelFile, small: nn.Module, spec: Any, shapes: tuple[Any, Any, Any]) -> tuple[FitQuantity, ...]:
    """``measure_carried`` at the traced shapes. A probe that fails here leaves nothing carried
    rather than the whole graph unbuilt: the graph also plans without a pipeline, and at pp > 1 the
    executor runs the same probe on the full model and reports its failure there."""
    try:
        return measure_carried(small, spec, *shapes)
    except Exception:
        clock = active_clock()
        if clock is not None and clock.expired:  # the time limit's interrupt is not the probe's failure
            raise clock.error(mf.path) from None
        return ()


def _inputs(mf: ModelFile, micro_batch: int, dtype: torch.dtype) -> Any:
    inp = mf.example_inputs(micro_batch, "meta")
    return _cast_float(inp, dtype)


def _cast_float(value: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, value)


def _region_params(small: nn.Module, param_regions: dict[int, set[str]], t2: Any, blocks_attr: str,
                   tp_plan: dict[str, str] | None, local_attrs: tuple[str, ...] = (),
                   edges: Edges | None = None) -> tuple[dict[str, RegionParams], int]:
    counts = {"pre": 0, "block": 0, "post": 0, "loss": 0}
    tensors = dict.fromkeys(counts, 0)
    shapes: dict[str, dict[tuple[int, int], int]] = {r: {} for r in counts}
    tied = 0
    seen: set[int] = set()
    for p in small.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        regions = param_regions.get(id(p), {"pre"})
        first = "pre" if "pre" in regions else ("block" if "block" in regions else sorted(regions)[0])
        counts[first] += p.numel()
        tensors[first] += 1
        rows = p.shape[0] if p.dim() else 1
        shape = (rows, p.numel() // rows if rows else 0)
        shapes[first][shape] = shapes[first].get(shape, 0) + 1
        if "pre" in regions and "post" in regions:
            tied += p.numel()
    sharded = {"pre": 0, "block": 0, "post": 0, "loss": 0}
    if t2 is not None and tp_plan:
        sharded_model = shard_for_tp(small, blocks_attr, tp_plan, 2, local_attrs, edges=edges)
        for (name, p), (_, q) in zip(small.named_parameters(), sharded_model.named_parameters()):
            if p.numel() != q.numel():
                regions = param_regions.get(id(p), {"pre"})
                first = "pre" if "pre" in regions else ("block" if "block" in regions else sorted(regions)[0])
                sharded[first] += p.numel()
    return {r: RegionParams(count=counts[r], tp_sharded=sharded[r], tensors=tensors[r],
                            shapes=tuple(sorted((*k, n) for k, n in shapes[r].items()))) for r in counts}, tied
