"""``autopar run --trace out.json``: the measured torch.profiler trace, in Chrome trace format.

Rank 0 profiles ``trace_steps`` training steps (after one warm-up step when the run has more than
one) with ``torch.profiler`` (CPU, plus CUDA on GPU) and writes ``out.json``; with
``--trace-all-ranks`` every rank r writes ``out.rank{r}.json`` (rank 0 included). The file opens in
Perfetto (ui.perfetto.dev) or chrome://tracing next to the predicted trace of ``autopar explain
--trace``. Files are written atomically (temp + rename): an interrupted run leaves no half trace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch


def trace_path(path: str | os.PathLike[str], rank: int, all_ranks: bool) -> Path | None:
    """Where ``rank`` writes its trace (None: this rank does not trace)."""
    p = Path(path)
    if not all_ranks:
        return p if rank == 0 else None
    stem = p.name[: -len(".json")] if p.name.endswith(".json") else p.name
    return p.with_name(f"{stem}.rank{rank}.json")


@dataclass(kw_only=True)
class StepTracer:
    """Drives a ``torch.profiler.profile`` schedule from the training loop (``step()`` after each
    training step) and exports the trace when the schedule completes or at ``close()``."""

    path: Path
    steps: int
    warmup: int

    def __post_init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._written = False
        self._prof = profile(
            activities=acts,
            schedule=schedule(wait=0, warmup=self.warmup, active=self.steps, repeat=1),
            on_trace_ready=self._export,
            record_shapes=True,
        )
        self._prof.__enter__()

    def _export(self, prof) -> None:
        from autopar.outputs import OutputError, resolve_target

        target = resolve_target(self.path, "--trace")  # a regular file (symlinks followed), never a FIFO
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, target)
        except OSError as exc:  # a full disk: one line, not a traceback after training ran
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise OutputError(f"cannot write --trace {self.path}: {exc.strerror or exc}") from None
        self._written = True

    def step(self) -> None:
        self._prof.step()

    def close(self) -> bool:
        """Stop profiling; writes what was recorded if the schedule had not completed. True when a
        trace file was written."""
        self._prof.__exit__(None, None, None)
        if not self._written:
            from autopar.errors import AutoparError

            try:
                self._export(self._prof)
            except AutoparError:
                raise
            except Exception:  # noqa: BLE001 - nothing recorded (no step ran)
                return False
        return self._written


def make_tracer(path: str | None, rank: int, *, all_ranks: bool, steps_to_run: int, trace_steps: int) -> StepTracer | None:
    if path is None:
        return None
    target = trace_path(path, rank, all_ranks)
    if target is None:
        return None
    warmup = 1 if steps_to_run > 1 else 0
    return StepTracer(path=target, steps=max(1, min(trace_steps, steps_to_run - warmup)), warmup=warmup)
