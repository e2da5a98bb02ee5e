"""The memory timeline of one forward+backward on the meta device: the step's temporaries, per
phase of each region.

The saved-tensor count (``graph/trace.py``) says what a step keeps from forward to backward; a
step's peak is higher by what exists only for a moment: a loss's full-vocabulary fp32 copies of
the logits and their gradients, a block's gradients of activations in backward, an unfused
attention's s^2 score gradients. ``live_peaks`` runs the same forward+backward again (nothing
recorded, no view bookkeeping that would keep tensors alive) under ``LiveBytes``, a dispatch mode
that counts each storage an op creates until Python frees it (a weakref on the storage: meta
storages are tracked like real ones), marks the ones autograd saves for backward, and reports per
(phase, region) the most bytes of *temporaries* -- live storages never saved -- at any op there:

    T(phase, region) = max over that phase's ops of the live bytes not saved for backward

For a model of n blocks the step's peak in that phase is the saved activations alive then (every
block's at the loss; the blocks not yet back-propagated at a block's backward) plus T: each
temporary has the shape of an activation or its gradient, so T scales like one (fitted in b, s and
1/tp). Parameter gradients are left out (the cost model counts them as gradients), as is anything
alive before the step.

Under FSDP2 (``fully_shard`` and ``replicate``) a unit's parameter gradients exist, unsharded in
the training dtype, from the op that makes them until the unit's post-backward folds them into its
accumulator or reduce input: through the rest of that region's backward. ``credited_peaks``
(``hold_grads``) replays the same events with them counted that way, region by region:

    Tg(bwd, region) = max over that phase's ops of (temporaries + the region's gradients made so far)

and reports at that op both parts, so that the cost model scales each by its own law (temporaries
like an activation, gradients like the region's parameters) and prices Tg where the executor's wrap
holds unit gradients (cost/stage.py, cost/zero.holds_unit_grads).

The cost model holds a region's saved activations whole beside its backward's peak, but backward
releases a saved tensor once the op that needed it has run: mid-block, at an unfused attention
core's backward, the MLP's saved tensors are gone. ``credited_peaks`` replays the events a third
way, crediting each backward (phase, region) with the saved storages freed there so far:

    T'(bwd, region)  = max over its ops of (temporaries - saved freed in it so far)
    Tg'(bwd, region) = max over its ops of (temporaries + its gradients - saved freed in it so far)

each reported as its parts at that op (the credit fitted like the activations it frees), so that
the cost model prices the saved activations at backward's start plus T' or Tg' (cost/stage.py,
where the activations it holds are the model file's own). A region's gradients are dropped
when its backward ends; the root unit's (embedding, head) live on to the end of the step, which the
cost model adds on the ranks that hold them. A weight used twice (a head tied to the embedding) has
its contributions summed by autograd before it accumulates: Tg counts each contribution as the
unit's gradient (the head's joins the root unit's), T keeps the early one a temporary -- what any
wrap holds at one pipeline stage, and what the cost model leaves out where stages split them.

Forward rise: T prices a forward's temporaries beside the region's whole saved set, but at its
forward's peak only what the region has saved so far is there. Where a block re-runs its forward
in backward (full recompute) the saved set it re-makes is priced whole beside the peak, and an
unfused attention's forward peak (the scores, before the saved probabilities) came out 150 MB over
a rehearsed GPT block of width 1,024 at 8 x 1,024 tokens. ``forward_rises`` reports

    R(fwd, region) = max over its forward's ops of (temporaries + saved made there so far) - all saved made there

as (temporaries, saved still to come); the cost model prices the larger of R and backward's Tg' /
T' beside the whole saved set.

Tg' envelope: which op peaks depends on the shape. Temporaries and credit grow with the
micro-batch and the sequence, the gradients only with the parameters: the trace's small batch
peaks at the end of a block's backward, where every gradient is held and every saved tensor
freed, a large one at its first weight gradient, where the first temporaries meet no credit yet
(a ViT block of width 512 at 8 images: 1.1 MB from the trace's peak, 5.2 MB from its MLP's
weight gradient, as rehearsed). ``backward_states`` keeps Tg''s parts after every backward op;
graph/scaling.py fits each op of their upper envelope (the ops that peak for some ratio of
activation to parameter scale), and the cost model takes the largest at the shape it prices.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.spec.meta import call_on_meta
from autopar.spec.meta_memo import flat_tensors

_SUMS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


@dataclass(kw_only=True)
class _Clock:
    phase: str = "fwd"
    region: str = "pre"


@dataclass(kw_only=True)
class LiveBytes(TorchDispatchMode):
    """Counts the storages ops create until they are freed; keeps an event list for replay."""

    clock: _Clock = field(default_factory=_Clock)
    events: list[tuple[int, int, str, str]] = field(default_factory=list)  # (+/- bytes, serial, phase, region)
    _live: dict[int, int] = field(default_factory=dict)  # id(storage) -> serial
    # backward's sums: serial -> the serials added into it (autograd's input buffer sums a tied
    # weight's contributions, the head's and the embedding's, before it accumulates the gradient)
    sums: dict[int, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def serial_of(self, t: torch.Tensor) -> int | None:
        return self._live.get(id(t.untyped_storage()))

    def _free(self, key: int, serial: int, nbytes: int) -> None:
        if self._live.get(key) == serial:
            del self._live[key]
        self.events.append((-nbytes, serial, self.clock.phase, self.clock.region))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = call_on_meta(func, args, kwargs or {})  # grouped_mm in fp32: backward's GEMMs reach this mode first
        inputs = {id(t.untyped_storage()) for t in flat_tensors((args, kwargs))}  # pytree's order, cheaper
        for t in flat_tensors(out):
            st = t.untyped_storage()
            key, nbytes = id(st), st.nbytes()
            if nbytes == 0 or key in inputs or key in self._live:
                continue
            serial = len(self.events)
            self._live[key] = serial
            self.events.append((nbytes, serial, self.clock.phase, self.clock.region))
            weakref.finalize(st, self._free, key, serial, nbytes)
        if self.clock.phase == "bwd" and func in _SUMS and isinstance(out, torch.Tensor):
            into = self.serial_of(out)  # add_: its first input's
            if into is not None:
                self.sums.setdefault(into, set()).update({self._live.get(key) for key in inputs} - {None, into})
        return out


def peaks_over(events: list[tuple[int, int, str, str]], leave_out: set[int]) -> dict[tuple[str, str], float]:
    """Replay ``events`` without the storages ``leave_out`` (saved tensors, parameter gradients):
    per (phase, region), the most live bytes there."""
    live, peaks = 0, {}
    for nbytes, serial, phase, region in events:
        if serial in leave_out:
            continue
        live += nbytes
        key = (phase, region)
        if nbytes > 0 and live > peaks.get(key, 0):
            peaks[key] = live
    return peaks


def _replay(events: list[tuple[int, int, str, str]], saved: set[int], grads: set[int], *, hold_grads: bool
            ) -> Iterator[tuple[tuple[str, str], int, int, int]]:
    """The credited replay of ``events`` (``credited_peaks``): after each backward op that makes a
    storage, its (phase, region) and (temporaries, gradients held, credit) then."""
    temps, own, freed, current = 0, 0, 0, None
    for nbytes, serial, phase, region in events:
        key = (phase, region)
        if key != current:  # a new region's backward: the unit's post-backward has folded its gradients away
            current, own, freed = key, 0, 0
        if serial in saved:
            if phase == "bwd" and nbytes < 0:
                freed -= nbytes
            continue
        if serial in grads:
            if not hold_grads or nbytes < 0:
                continue  # freed with p.grad after the step, or a contribution once summed: counted to its region's end
            own += nbytes
        else:
            temps += nbytes
        if phase == "bwd" and nbytes > 0:
            yield key, temps, own, freed


def credited_peaks(events: list[tuple[int, int, str, str]], saved: set[int], grads: set[int], *,
                   hold_grads: bool) -> dict[tuple[str, str], tuple[float, float, float]]:
    """Replay ``events`` crediting, in each backward (phase, region), the saved storages ``saved``
    freed there so far; the parameter gradients ``grads`` counted from their creation until their
    (phase, region) ends where ``hold_grads`` (Tg'), left out otherwise (T'). Per backward (phase,
    region), at its most of temporaries + gradients - credit: (temporaries, gradients, credit)
    (module docstring)."""
    peaks: dict[tuple[str, str], tuple[float, float, float]] = {}
    for key, temps, own, freed in _replay(events, saved, grads, hold_grads=hold_grads):
        best = peaks.get(key)
        if best is None or temps + own - freed > best[0] + best[1] - best[2]:
            peaks[key] = (float(temps), float(own), float(freed))
    return peaks


def backward_states(events: list[tuple[int, int, str, str]], saved: set[int], grads: set[int]
                    ) -> dict[tuple[str, str], tuple[tuple[float, float, float], ...]]:
    """Tg''s replay (``credited_peaks`` holding gradients) at every backward op that makes a storage,
    in order, per backward (phase, region): (temporaries, gradients held, credit) after it. Which op
    peaks depends on the shape: temporaries and credit grow with the micro-batch, gradients with the
    parameters only, so a small traced batch peaks where the most gradients are held and a large
    one where the most temporaries are (module docstring, Tg' envelope)."""
    states: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for key, temps, own, freed in _replay(events, saved, grads, hold_grads=True):
        states.setdefault(key, []).append((float(temps), float(own), float(freed)))
    return {key: tuple(v) for key, v in states.items()}


def forward_rises(events: list[tuple[int, int, str, str]], saved: set[int], leave_out: set[int]
                  ) -> dict[tuple[str, str], tuple[float, float]]:
    """Per forward (phase, region): at its op with the most temporaries + the saved storages made in
    the region's forward so far, less all it makes in its forward (module docstring, forward rise),
    (temporaries, saved bytes still to come). ``leave_out``: storages that are neither (gradients)."""
    totals: dict[tuple[str, str], int] = {}
    for nbytes, serial, phase, region in events:
        if phase == "fwd" and serial in saved:
            totals[(phase, region)] = totals.get((phase, region), 0) + nbytes
    temps, made, current = 0, 0, None
    rises: dict[tuple[str, str], tuple[float, float]] = {}
    for nbytes, serial, phase, region in events:
        key = (phase, region)
        if key != current:
            current, made = key, 0
        if serial in saved:
            if phase == "fwd":
                made += nbytes
            continue
        if serial in leave_out:
            continue
        temps += nbytes
        if phase == "fwd" and nbytes > 0:
            to_come = totals.get(key, 0) - made
            best = rises.get(key)
            if best is None or temps - to_come > best[0] - best[1]:
                rises[key] = (float(temps), float(to_come))
    return rises


def _with_contributions(grads: set[int], sums: dict[int, set[int]]) -> set[int]:
    """``grads`` and every storage summed into one of them in backward, transitively: the
    contributions of a parameter used more than once are its gradient, made early."""
    out, todo = set(), list(grads)
    while todo:
        serial = todo.pop()
        if serial not in out:
            out.add(serial)
            todo.extend(sums.get(serial, ()))
    return out


@dataclass(frozen=True, kw_only=True)
class LivePeaks:
    """``live_peaks``' result, per (phase, region): T; per backward (phase, region): T' as
    (temporaries, 0, credit) and Tg' as (temporaries, unit gradients, credit) (module docstring)."""

    temps: dict[tuple[str, str], float]
    credited: dict[tuple[str, str], tuple[float, float, float]]
    with_grads: dict[tuple[str, str], tuple[float, float, float]]
    # Tg''s parts after every backward op (``backward_states``): where the peak falls at other shapes
    grads_states: dict[tuple[str, str], tuple[tuple[float, float, float], ...]] = field(default_factory=dict)
    # per forward (phase, region): the rise above its whole saved set (``forward_rises``)
    rises: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)


def live_peaks(step: Callable[[Callable[[str], None]], Any], params: list[torch.Tensor]) -> LivePeaks:
    """Run ``step(set_region)`` (forward and backward; ``set_region`` as ``graph.trace.run_and_trace``
    takes it) under ``LiveBytes``; T, T' and Tg' (module docstring)."""
    from autopar.graph.trace import cuda_like_functions

    for p in params:
        p.grad = None
    mode = LiveBytes()

    def set_region(name: str) -> None:
        if name.startswith("bwd:"):
            mode.clock.phase, mode.clock.region = "bwd", name[4:]
        else:
            mode.clock.region = name

    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        serial = mode.serial_of(t)
        if serial is not None:
            saved.add(serial)
        return t

    with cuda_like_functions(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        step(set_region)
    grads = {mode.serial_of(p.grad) for p in params if p.grad is not None} - {None}
    for p in params:
        p.grad = None
    # T leaves out the gradients the model states count (a tied weight's early contribution stays a
    # temporary: autograd holds it, whatever the wrap); Tg counts every contribution as the unit's
    held = _with_contributions(grads, mode.sums)
    return LivePeaks(temps=peaks_over(mode.events, grads | saved),
                     credited=credited_peaks(mode.events, saved, grads, hold_grads=False),
                     with_grads=credited_peaks(mode.events, saved, held, hold_grads=True),
                     grads_states=backward_states(mode.events, saved, held),
                     rises=forward_rises(mode.events, saved, grads))
