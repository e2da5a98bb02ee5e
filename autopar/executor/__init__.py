"""The executor: ``autopar run`` applies a plan to the user's real model with torch.distributed.

Three folders by role, one concern per module; ``parallel/apply.py`` is the only place that fixes
the order in which a plan is applied, ``runtime/start.py`` the only one that brings a plan up:

==============================  =================================================================
parallel/mesh.py                DeviceMesh ``[pp, dp, cp, tp]`` (tp innermost; autopar/layout.py)
                                and this rank's coordinates
parallel/pipeline_parallel.py   cut into stage chunks (uneven ranges, virtual stages),
                                PipelineStage and GPipe / 1F1B / interleaved-1F1B schedules,
                                tied-weight gradient sync
parallel/tensor_parallel.py     DTensor Colwise/Rowwise (+ Megatron SP), fused-QKV interleaving
parallel/context_parallel.py    ring / all-gather-KV / Ulysses attention, load-balanced causal
                                sharding
parallel/recompute.py           full and selective activation checkpointing
parallel/data_parallel.py       DDP, ZeRO-1/2/3 (FSDP2; ZeRO-1 syncs gradients once per step)
parallel/apply.py               meta build -> PP split -> TP -> CP -> recompute -> materialise ->
                                ZeRO/DP
parallel/batch.py               a batch's rows and device (shared by train.py and
                                pipeline_parallel.py)
checkpoint/checkpoint.py        sharded DCP checkpoints keyed by full-model names (resume under
                                any plan), atomic step-N.tmp -> step-N rename and ``latest``
checkpoint/checkpoint_meta.py   ``meta.json``, the checkpoint's record (no torch); integrity.py
                                checks it
runtime/introspect.py/checks    what the model offers (blocks, tp_plan, attention core, heads);
                                pre-flight checks that turn every impossible plan into a
                                one-line AutoparError
runtime/start.py                the one bring-up of a plan on a rank: preflight -> process group
                                -> mesh -> executable (run, validate, apply_plan, benchmarks)
runtime/train.py                data, micro-batches, optimizer steps, metrics, single-process
                                reference
runtime/faults.py               per-group timeouts, flight-recorder failure messages (rank +
                                collective), watchdog, test fault injection
runtime/tracing.py              ``--trace``: measured torch.profiler trace (Chrome format)
runtime/rank_main.py            what each rank does: bring-up, resume, train with hooks, report
runtime/run_options.py          ``RunOptions``: the validated options of one run, handed to every
                                rank
runtime/run_report.py           the run's JSON report and measured-vs-predicted table
==============================  =================================================================

``autopar run``'s arguments, their validation and the re-launch are the command's
(autopar/commands/run.py).
"""
