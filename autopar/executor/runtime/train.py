"""The training loop: deterministic data, micro-batches / gradient accumulation, metrics.

Data: the model file's ``dataset(global_batch_size, step, seed)`` when it defines one (it returns one
global batch in ``example_inputs`` form); otherwise synthetic: the shapes and dtypes of
``example_inputs(global_batch_size)`` with values redrawn per step from a generator seeded by
(seed, step) -- integers uniform in [0, max(example)] (token ids stay inside the vocabulary),
floats standard normal. ``example_inputs`` itself runs under torch's random state seeded by (seed,
step) and restored after (``torch.random.fork_rng``): a model file that draws its example with
``torch.randint`` would otherwise set the range from whatever state training had left -- which
dropout and the plan's micro-batching change -- and a run resumed under another plan would train
on other data. A step's batch is a function of (seed, step) alone. Every rank builds the same
global batch and takes its dp slice (rows [d·G/dp, (d+1)·G/dp)), then micro-batches of
``micro_batch_size``; the single-process reference (``run_reference``) walks the same rows, so
losses and parameters must match.

Loss semantics (= the reference): the mean over all micro-batches of ``loss_fn`` per micro-batch.
With tp > 1 the output head returns logits sharded on the vocabulary and the loss runs
vocab-parallel: ``loss_fn`` through ``tensor_parallel.VocabParallelLoss``, and each step's forward
and backward inside ``loss_parallel()`` (``loss_context``); see executor/parallel/tensor_parallel.py for why
and for the fallback to all-gathered logits when a loss_fn cannot run on a DTensor. The CP loss
(``cp_next_token_loss``) is a plain ``F.cross_entropy`` and runs on the sharded logits as it is; a
Hugging Face causal-LM dict batch (``{"input_ids", "labels"}``) gets HF's label loss, the targets
built from its labels (``_cp_dict_loss``).

Gradient statistics (``train(measure_noise=True)``, ``adascale=``): the gradient noise scale of every
step, from the squared norms of the local and the reduced gradient (grad_norms.py, noise_scale.py),
and AdaScale's learning-rate gain driven by them (adascale.py). Measuring adds one all-reduce of four
scalars per step, before the optimizer step (AdaScale needs the gain for that step's update).

Peak memory per rank: ``torch.cuda.max_memory_allocated`` on GPU. On CPU there are no allocator
statistics, so it is the growth of the process's peak RSS (``getrusage ru_maxrss``) over its value
when the run started -- includes allocator slack and the full-model copy used for initialisation.
"""

from __future__ import annotations

import resource
import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError
from autopar.executor.parallel.apply import Executable
from autopar.executor.parallel.batch import rows, to_device
from autopar.executor.parallel.context_parallel import (
    cp_next_token_loss,
    dict_batch,
    is_label_loss,
    is_next_token_loss,
    logits_of,
    num_targets_of,
    position_kwargs,
    shard_batch,
)
from autopar.executor.parallel.data_parallel import (
    MIXED_PRECISION_KINDS,
    build_optimizer,
    replicate_microbatch,
    zero1_microbatch,
)
from autopar.executor.parallel.host_reference import build_reference
from autopar.executor.parallel.pipeline_parallel import run_schedule, sync_tied_grads
from autopar.executor.parallel.tensor_parallel import VocabParallelLoss, loss_context
from autopar.executor.runtime.adascale import AdaScale, AdaScaleReport, scaled_lr
from autopar.executor.runtime.grad_norms import GradNormMeter, Unmeasured, install
from autopar.executor.runtime.grouped_autocast import holds_stacked_weights, with_grouped_autocast
from autopar.executor.runtime.noise_scale import NoiseScaleEstimator, NoiseScaleReport, NormSample
from autopar.executor.runtime.steady import steady_state
from autopar.modelfile import ModelFile, call_model
from autopar.plan import Plan
from autopar.torch_dtypes import TORCH_DTYPES

CP_LOSS_ERROR = "context parallelism needs loss_fn to be mean next-token cross-entropy"


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """Measured outcome of a run (identical on every rank)."""

    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]  # per step, max over ranks
    step_time_s: float  # median of the steady steps, after the warm-up (autopar.executor.runtime.steady)
    tokens_per_s: float
    peak_memory_bytes: tuple[int, ...]  # per rank
    memory_measure: str
    notes: tuple[str, ...] = ()
    start_step: int = 0  # index of the first step run here (> 0 after a resume); losses[i] is step start_step + i
    noise_scale: NoiseScaleReport | None = None  # measured gradient noise scale (train(measure_noise=True))
    noise_scale_note: str | None = None  # why it was not measured, where it was asked for and not measured
    adascale: AdaScaleReport | None = None


@dataclass(frozen=True, kw_only=True)
class AdaScaleOptions:
    """``autopar run --adascale``: scale the learning rate by AdaScale's gain (adascale.py); with
    ``target_steps``, stop once the scale-invariant step counter reaches it."""

    target_steps: float | None = None


class _Statistics:
    """The gradient noise scale and AdaScale of one run (every rank holds identical ones)."""

    def __init__(self, meter: GradNormMeter, adascale: AdaScale | None) -> None:
        self.meter, self.adascale = meter, adascale
        self.noise = NoiseScaleEstimator()
        self.step = 0
        self.last_b_simple: float | None = None

    def on_sample(self, sample: NormSample) -> float:
        """Fold in a step's squared norms; the learning-rate gain of its update (1 without AdaScale)."""
        self.step += 1
        self.last_b_simple = self.noise.update(self.step, sample).b_simple
        return self.adascale.update(self.step, sample).gain if self.adascale is not None else 1.0

    def log_suffix(self) -> str:
        b = self.last_b_simple
        text = "  B_simple " + ("n/a" if b is None else f"{b:,.1f}")
        if self.adascale is not None:
            a = self.adascale
            target = f"/{a.target:g}" if a.target is not None else ""
            text += f"  gain {a.gain:.3f}  scale-invariant step {a.progress:.2f}{target}"
        return text


@dataclass(frozen=True, kw_only=True)
class StepHooks:
    """Optional callbacks of the training loop (all run on every rank).

    ``before_step(step)``: before step index ``step`` (fault injection in tests);
    ``after_step(steps_done, loss)``: after the step's loss is known (checkpoint saves; collective);
    ``guard(phase)``: a context manager around each phase ("step 4", "checkpoint after step 4")
    that turns a collective timeout or a dead peer into a one-line error (faults.py);
    ``profile_step()``: called after each step (the torch.profiler schedule, tracing.py).
    """

    before_step: Callable[[int], None] | None = None
    after_step: Callable[[int, float], None] | None = None
    guard: Callable[[str], AbstractContextManager] | None = None
    profile_step: Callable[[], None] | None = None


def _redraw(x: Any, g: torch.Generator) -> Any:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point:
            return torch.randn(x.shape, generator=g, dtype=x.dtype)
        if x.dtype == torch.bool:
            return torch.randint(0, 2, x.shape, generator=g).bool()
        high = int(x.max().item()) + 1 if x.numel() else 1
        return torch.randint(0, max(high, 1), x.shape, generator=g, dtype=x.dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_redraw(v, g) for v in x)
    if isinstance(x, dict):
        return {k: _redraw(v, g) for k, v in x.items()}
    return x


def global_batch(mf: ModelFile, size: int, step: int, seed: int) -> Any:
    """The step's global batch on CPU (see module docstring)."""
    dataset = getattr(mf.module, "dataset", None)
    if callable(dataset):
        return dataset(size, step, seed)
    step_seed = seed * 1_000_003 + step
    with torch.random.fork_rng(devices=[]):  # the example's own draws: of (seed, step), not the run so far
        torch.manual_seed(step_seed)
        example = mf.example_inputs(size, "cpu")
    return _redraw(example, torch.Generator().manual_seed(step_seed))


def rank_batch(exe: Executable, mf: ModelFile, step: int, seed: int) -> Any:
    """This rank's data-parallel rows of global batch ``step`` of ``seed``, on its device."""
    g = exe.plan.training.global_batch_size
    per_dp, d = g // exe.plan.parallel.dp, exe.mesh.coords.dp
    return to_device(rows(global_batch(mf, g, step, seed), d * per_dp, (d + 1) * per_dp), exe.mesh.device)


def _autocast(plan: Plan, device: torch.device, fsdp: bool, stacked: bool = False):
    """bf16/fp16 autocast for DDP and unwrapped parts (``fsdp``: FSDP2 and ``replicate`` cast via
    their MixedPrecisionPolicy); ``stacked``: the model holds weights stacked per expert, whose
    grouped GEMMs autocast does not cast (grouped_autocast.py)."""
    if plan.training.dtype == "fp32" or fsdp:
        return nullcontext()
    dtype = TORCH_DTYPES[plan.training.dtype]
    return with_grouped_autocast(torch.autocast(device.type, dtype=dtype), device.type, dtype, stacked)


def cuda_device_peak_bytes(device: torch.device) -> tuple[int, int]:
    """(tensor peak, device-level peak) of this process on a CUDA device since the last
    ``reset_peak_memory_stats``: ``max_memory_allocated``, and what the device held at the allocator's
    peak -- the caching allocator's peak reservation plus everything outside it (the CUDA context,
    cuBLAS workspaces, NCCL's buffers: device use from ``mem_get_info`` less the allocator's current
    reservation). The second is what must fit the GPU; their difference is the measured reserve
    and the allocator's slack."""
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    return int(torch.cuda.max_memory_allocated(device)), int(outside + torch.cuda.max_memory_reserved(device))


def peak_memory_bytes(device: torch.device, baseline: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline)


def rss_baseline() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Trainer:
    def __init__(self, exe: Executable, mf: ModelFile) -> None:
        self.exe, self.mf, self.plan = exe, mf, exe.plan
        if mf.loss_fn is None:
            raise AutoparError(f"{mf.path} defines no loss_fn(output, inputs); the executor needs one to train")
        # tp > 1: the head's logits arrive vocab-sharded; a pass-through for plain outputs.
        self.vocab_loss = VocabParallelLoss(mf.loss_fn)
        self.loss_fn: Callable = self.vocab_loss if exe.plan.parallel.tp > 1 else mf.loss_fn
        self.checked_cp_loss = False
        self.stacked = holds_stacked_weights(exe.parts)  # grouped GEMMs to cast under autocast (grouped_autocast.py)
        self.stats: _Statistics | None = None  # train(measure_noise=True): gradient statistics per step

    def step(self, batch: Any, on_grads: Callable[[], None] | None = None) -> torch.Tensor:
        """One optimizer step on this rank's dp slice; returns this rank's loss contribution.

        ``on_grads`` runs after the gradients are final (reduced, tied copies synced) and before
        the optimizer step -- the tests use it to compare gradients with the reference.
        """
        exe, plan = self.exe, self.plan
        par, mbs, m = plan.parallel, plan.training.micro_batch_size, plan.num_microbatches
        fsdp = any(w.kind in MIXED_PRECISION_KINDS for w in exe.dp)
        stats = self.stats
        if stats is not None:
            stats.meter.begin_step()
        with _autocast(plan, exe.mesh.device, fsdp, self.stacked), loss_context(par.tp):
            if exe.schedule is not None:
                contrib = self._pipeline_step(batch)
            else:
                contrib = self._flat_step(batch, mbs, m)
        # the reduced gradients, before tied copies are summed (grad_norms.py); collective
        gain = stats.on_sample(stats.meter.finish()) if stats is not None else 1.0
        if exe.tied:
            sync_tied_grads(exe.parameter_copies(), exe.tied)
        if on_grads is not None:
            on_grads()
        with scaled_lr(exe.optimizer, gain) if gain != 1.0 else nullcontext():
            exe.optimizer.step()
        exe.optimizer.zero_grad(set_to_none=True)
        return contrib

    def _flat_step(self, batch: Any, mbs: int, m: int) -> torch.Tensor:
        exe, par = self.exe, self.plan.parallel
        model, kind = exe.parts[0], exe.dp[0].kind
        contrib = torch.zeros((), device=exe.mesh.device)
        for i in range(m):
            mb = rows(batch, i * mbs, (i + 1) * mbs)
            sync = model.no_sync() if kind == "ddp" and i < m - 1 else nullcontext()
            if exe.dp[0].zero1:  # one reduce-scatter and one all-gather per step (data_parallel.py)
                zero1_microbatch(model, last=i == m - 1)
            elif kind == "replicate":  # one all-reduce per step, as DDP's no_sync gives
                replicate_microbatch(model, last=i == m - 1)
            with sync:
                if par.cp > 1:
                    loss = self._cp_loss(model, mb)
                else:
                    loss = self.loss_fn(call_model(model, mb), mb)
                (loss / m).backward()
            contrib += loss.detach().float() / m
        return contrib

    def _cp_loss(self, model: nn.Module, mb: Any) -> torch.Tensor:
        par, spec = self.plan.parallel, self.exe.spec
        if spec.token_key is not None:
            return self._cp_dict_loss(model, mb)
        tokens = mb
        local, positions, targets = shard_batch(tokens, par.cp, self.exe.mesh.coords.cp)
        output = model(local, **position_kwargs(spec.accepts_positions, positions))
        logits = logits_of(output)[0]
        if not self.checked_cp_loss:
            if not is_next_token_loss(self.mf.loss_fn, tokens, logits.shape[-1], output):
                raise AutoparError(CP_LOSS_ERROR)
            self.checked_cp_loss = True
        loss = cp_next_token_loss(logits, targets, tokens.shape[0] * (tokens.shape[1] - 1), par.cp)
        # tp > 1: vocab-parallel cross-entropy (loss_parallel), replicated over tp -> a plain scalar.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _cp_dict_loss(self, model: nn.Module, mb: Any) -> torch.Tensor:
        """A Hugging Face causal-LM micro-batch (context_parallel.py): the model gets this rank's
        input_ids and position_ids, no labels; the loss is HF's label loss over the whole sequence."""
        par, spec = self.plan.parallel, self.exe.spec
        tokens, labels = dict_batch(mb, spec.token_key, spec.labels_key)
        if not self.checked_cp_loss:  # once, before the first sharded forward (collective over all ranks)
            if not is_label_loss(model, self.mf.loss_fn, mb, spec.token_key, spec.labels_key, par.cp):
                raise AutoparError(CP_LOSS_ERROR)
            self.checked_cp_loss = True
        local, positions, targets = shard_batch(tokens, par.cp, self.exe.mesh.coords.cp, labels=labels)
        output = model(**{spec.token_key: local}, **position_kwargs(spec.accepts_positions, positions))
        loss = cp_next_token_loss(logits_of(output)[0], targets, num_targets_of(labels), par.cp)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _pipeline_step(self, batch: Any) -> torch.Tensor:
        exe, par = self.exe, self.plan.parallel
        target = batch
        if par.cp > 1:  # shard tokens and next-token targets; StageModule passes the positions
            if not self.checked_cp_loss:
                like = exe.pipe_io.example_output(batch.device)
                if not is_next_token_loss(self.mf.loss_fn, batch, int(batch.max()) + 1, like):
                    raise AutoparError(CP_LOSS_ERROR)
                self.checked_cp_loss = True
            batch, _, target = shard_batch(batch, par.cp, exe.mesh.coords.cp)
        is_last = self.plan.parallel.num_stage_chunks - 1 in exe.chunk_ids
        if exe.pipe_io is None:  # chain chunks (chain_pipeline.py): only the first stage takes the inputs
            losses: list[torch.Tensor] = []
            if 0 in exe.chunk_ids:
                exe.schedule.step(batch)
            elif is_last:
                exe.schedule.step(target=target, losses=losses)
            else:
                exe.schedule.step()
        else:
            losses = run_schedule(exe.schedule, exe.pipe_io, batch, is_last=is_last,
                                  target=target if par.cp > 1 else None)
        if is_last and losses:
            # tp > 1: the schedule's loss_fn ran on vocab-sharded logits; its losses are replicated DTensors.
            return torch.stack([(l.full_tensor() if isinstance(l, DTensor) else l).detach().float()
                                for l in losses]).mean()
        return torch.zeros((), device=exe.mesh.device)


def _time_left(times: list[float], remaining: int) -> str:
    """``  ~12 s left``: the remaining steps at the median step time so far (the first step, the
    warm-up, only while it is the only one); empty after the last step."""
    if remaining <= 0 or not times:
        return ""
    left = remaining * statistics.median(times[1:] or times)
    if left < 1:
        return "  <1 s left"
    return f"  ~{left:.0f} s left" if left < 120 else f"  ~{left / 60:.1f} min left"


def train(
    exe: Executable, mf: ModelFile, *, steps: int, seed: int, log: Callable[[str], None] | None = None,
    on_grads: Callable[[int], None] | None = None, start_step: int = 0, hooks: StepHooks | None = None,
    measure_noise: bool = False, adascale: AdaScaleOptions | None = None,
) -> RunResult:
    """Run optimizer steps ``start_step .. steps - 1`` (collective). Every rank returns the same
    RunResult. Step ``s`` always trains on global batch ``s`` of ``seed`` (the data position), so a
    run resumed at ``start_step`` sees exactly the batches the uninterrupted run would have.

    ``on_grads(step)``: optional hook between backward and the optimizer step (see _Trainer.step).
    ``measure_noise``: measure the gradient noise scale where the plan allows (grad_norms.install);
    ``adascale``: also scale the learning rate by AdaScale's gain (needs a measured run; with a
    target, the run stops early once the scale-invariant counter reaches it, ``steps`` a bound).
    """
    plan, device = exe.plan, exe.mesh.device
    par, g = plan.parallel, plan.training.global_batch_size
    hooks = hooks or StepHooks()
    guard = hooks.guard or (lambda phase: nullcontext())
    baseline = rss_baseline()
    if device.type == "cuda":  # the steps' peak, not the build's (materialising, sharding, lazy init)
        torch.cuda.reset_peak_memory_stats(device)
    trainer = _Trainer(exe, mf)
    note = None
    if measure_noise or adascale is not None:
        trainer.stats, note = _start_statistics(exe, adascale, start_step)
    stats = trainer.stats
    target = adascale.target_steps if adascale is not None else None
    losses, times = [], []
    for step in range(start_step, steps):
        if hooks.before_step is not None:
            hooks.before_step(step)
        batch = rank_batch(exe, mf, step, seed)
        with guard(f"step {step + 1}"):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            contrib = trainer.step(batch, None if on_grads is None else lambda: on_grads(step))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            measured = torch.tensor([float(contrib), elapsed], dtype=torch.float64, device=device)
            total = measured[:1].clone()
            dist.all_reduce(total)
            dist.all_reduce(measured[1:], op=dist.ReduceOp.MAX)
        loss = float(total) / (par.dp * par.cp * par.tp)
        losses.append(loss)
        times.append(float(measured[1]))
        if log is not None:
            of = "" if target is not None else f"/{steps}"
            left = "" if target is not None else _time_left(times, steps - step - 1)
            log(f"step {step + 1}{of}  loss {loss:.6f}  time {times[-1] * 1e3:.1f} ms  "
                f"tokens/s {g * plan.training.seq_len / times[-1]:.0f}" + (stats.log_suffix() if stats else "") + left)
        if hooks.profile_step is not None:
            hooks.profile_step()
        if hooks.after_step is not None:
            with guard(f"checkpoint after step {step + 1}"):
                hooks.after_step(step + 1, loss)
        if stats is not None and stats.adascale is not None and stats.adascale.reached():
            break
    noise = stats.noise.report() if stats is not None and stats.noise.report().steps else None
    if log is not None:
        if noise is not None:
            log(f"gradient noise scale: {noise.summary()}")
        elif note is not None:
            log(f"note: gradient noise scale not measured: {note}")
        if stats is not None and stats.adascale is not None:
            a = stats.adascale
            log(f"adascale: {len(losses)} steps at scale {a.scale:g} made {a.progress:.2f} scale-invariant steps "
                f"(mean gain {a.progress / max(1, len(losses)):.3f})")
    peak = torch.tensor([peak_memory_bytes(device, baseline if device.type != "cuda" else 0)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, peak)
    # A loss fallback note is raised on the ranks that compute the loss (the last pipeline stage):
    # gathered, so that every rank reports it.
    mine = [v.note for v in (trainer.vocab_loss, exe.stage_loss) if v is not None and v.note]
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    loss_notes = tuple(dict.fromkeys(n for ns in every for n in (ns or [])))
    steady = steady_state(times).step_time_s
    return RunResult(
        losses=tuple(losses),
        step_times_s=tuple(times),
        step_time_s=steady,
        tokens_per_s=g * plan.training.seq_len / steady if steady > 0 else 0.0,
        peak_memory_bytes=tuple(int(t.item()) for t in gathered),
        memory_measure="torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS growth (getrusage ru_maxrss)",
        notes=tuple(exe.notes) + loss_notes,
        start_step=start_step,
        noise_scale=noise,
        noise_scale_note=note,
        adascale=stats.adascale.report() if stats is not None and stats.adascale is not None else None,
    )


def _start_statistics(exe: Executable, adascale: AdaScaleOptions | None,
                      start_step: int) -> tuple[_Statistics | None, str | None]:
    """Hook the gradient statistics into ``exe`` (grad_norms.install), or why not. AdaScale's scale
    is FairScale's: dp x micro-batches per step, one rank's micro-batch being scale 1."""
    meter = install(exe)
    if isinstance(meter, Unmeasured):
        if adascale is not None:
            raise AutoparError(f"--adascale needs the gradient statistics, which this plan does not measure: {meter.reason}")
        return None, meter.reason
    ada = None
    if adascale is not None:
        plan = exe.plan
        ada = AdaScale(scale=plan.parallel.dp * plan.num_microbatches, unit_batch_samples=plan.training.micro_batch_size,
                       target=adascale.target_steps)
    stats = _Statistics(meter, ada)
    stats.step = start_step
    return stats, None


def run_reference(
    mf: ModelFile, plan: Plan, *, steps: int, seed: int, lr: float, on_grads: Callable[[int, nn.Module], None] | None = None
) -> tuple[list[float], nn.Module]:
    """Single-process run of the same model, seed, data and optimizer: the equivalence oracle."""
    model = build_reference(mf, seed)
    opt = build_optimizer(list(model.parameters()), plan.training.optimizer, lr, False, None)
    g, mbs = plan.training.global_batch_size, plan.training.micro_batch_size
    n = g // mbs
    stacked = holds_stacked_weights([model])
    losses = []
    for step in range(steps):
        batch = global_batch(mf, g, step, seed)
        total = 0.0
        for i in range(n):
            mb = rows(batch, i * mbs, (i + 1) * mbs)
            with _autocast(plan, torch.device("cpu"), False, stacked):
                loss = mf.loss_fn(call_model(model, mb), mb)
            (loss / n).backward()
            total += float(loss.detach()) / n
        if on_grads is not None:
            on_grads(step, model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, model
