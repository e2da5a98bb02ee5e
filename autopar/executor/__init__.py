"""The executor: ``autopar run`` applies a plan to the user's real model with torch.distributed.

One concern per module; ``apply.py`` is the only place that fixes the order:

=====================  ==========================================================================
mesh.py                DeviceMesh ``[pp, dp, cp, tp]`` (tp innermost; autopar/layout.py) and this rank's
                       coordinates
introspect.py/checks   what the model offers (blocks, tp_plan, attention core, heads); pre-flight
                       checks that turn every impossible plan into a one-line AutoparError
pipeline_parallel.py   cut into stage chunks (uneven ranges, virtual stages), PipelineStage and
                       GPipe / 1F1B / interleaved-1F1B schedules, tied-weight gradient sync
tensor_parallel.py     DTensor Colwise/Rowwise (+ Megatron SP), fused-QKV interleaving
context_parallel.py    ring / all-gather-KV / Ulysses attention, load-balanced causal sharding
recompute.py           full and selective activation checkpointing
data_parallel.py       DDP, ZeRO-1/2/3 (FSDP2; ZeRO-1 syncs gradients once per step)
apply.py               meta build -> PP split -> TP -> CP -> recompute -> materialise -> ZeRO/DP
train.py               data, micro-batches, optimizer steps, metrics, single-process reference
batch.py               a batch's rows and device (shared by train.py and pipeline_parallel.py)
checkpoint.py          sharded DCP checkpoints keyed by full-model names (resume under any plan),
                       atomic step-N.tmp -> step-N rename and ``latest`` pointer
checkpoint_meta.py     ``meta.json``, the checkpoint's record (no torch); integrity.py checks it
faults.py              per-group timeouts, flight-recorder failure messages (rank + collective),
                       watchdog, test fault injection
tracing.py             ``--trace``: measured torch.profiler trace (Chrome format)
start.py               the one bring-up of a plan on a rank: preflight -> process group -> mesh ->
                       executable (run, validate, apply_plan and the benchmarks call it)
rank_main.py           what each rank does: init, build, resume, train with hooks, report
run_options.py         ``RunOptions``: the validated options of one run, handed to every rank
run_report.py          the run's JSON report and measured-vs-predicted table
=====================  ==========================================================================

``autopar run``'s arguments, their validation and the re-launch are the command's
(autopar/commands/run.py).
"""
