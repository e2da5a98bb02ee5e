"""A fake world for one rank: torch's fake process group and fake tensors, nothing allocated.

``fake_rank(rank, world_size)`` makes this process rank ``rank`` of a ``world_size``-rank job on
torch's ``"fake"`` backend (``torch.testing._internal.distributed.fake_pg``): every collective
returns at once without moving data, so one CPU process can bring up any rank of any plan. Inside
``fake_tensors()`` every tensor created is a ``FakeTensor``: shape, dtype, device and storage size,
no data, so a 405 B-parameter rank costs no memory and its ops cost no FLOPs.

Three pieces of code read tensor *values* where a real run would have them, and are given what a
real run would compute:

* ``DeviceMesh`` finds a rank's coordinates with ``nonzero`` on its mesh tensor (a data-dependent
  shape, refused on fake tensors); meshes are built outside the fake mode (``_real_meshes``).
* ``torch.distributed.pipelining``'s warm-up (torch >= 2.13) votes over the pipeline ranks on
  whether each stage's shapes were given up front, reading the received vote's value. A rehearsal
  gives every stage its shapes (executor/parallel/apply.py ``place(fake=True)``), so the vote's result is
  known: static shapes on every stage (``_static_pipeline_warmup``).
* Hugging Face's check for packed sequences, which skips building an attention mask when nothing
  is packed, takes fake tensors for a trace and builds the mask; it is answered "not packed", as a
  real run of a plain batch answers it (``_plain_hf_batches``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily


@contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` on the fake backend; the group is destroyed on
    exit. Refuses to run inside an initialised process group (a real job's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs a process of its own: a process group is already initialised")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Every tensor made inside is fake; real tensors passed in (a batch) are converted."""
    with ExitStack() as stack:
        stack.enter_context(_real_meshes())
        stack.enter_context(_static_pipeline_warmup())
        stack.enter_context(_plain_hf_batches())
        yield stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))


@contextmanager
def _real_meshes() -> Iterator[None]:
    """DeviceMesh construction (FSDP2 concatenates the dp and tp meshes) outside the fake mode."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: object, **kwargs: object) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


@contextmanager
def _static_pipeline_warmup() -> Iterator[None]:
    """The pipelining warm-up's vote answered as every stage would: static shapes (module docstring)."""
    from torch.distributed.pipelining import schedules

    base = schedules._PipelineSchedule
    original = getattr(base, "_warmup_p2p", None)
    if original is None:  # older torch: no vote; stages with static shapes exchange nothing
        yield
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(self: object, stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    base._warmup_p2p = warmup  # type: ignore[attr-defined]
    try:
        yield
    finally:
        base._warmup_p2p = original  # type: ignore[attr-defined]


@contextmanager
def _plain_hf_batches() -> Iterator[None]:
    """Hugging Face's "are sequences packed?" check answered as a real run of a plain batch answers it.

    transformers reads ``(packed_sequence_mask[:, -1] == 0).all()`` to skip building an attention mask,
    but takes any FakeTensor for a trace and builds the mask: a rehearsal would then carry a
    (batch, 1, seq, seq) mask per micro-batch and run SDPA with it (the memory-efficient kernel on a
    GPU) where the real run of an unpacked batch runs causal flash attention without one. Position ids
    that are fake are those the model made itself from ``arange`` (a batch's own are real): not packed."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def find(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if isinstance(position_ids, FakeTensor) else original(position_ids)

    masking.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def real_cpu(value: object) -> object:
    """``value`` with every tensor leaf made real on the CPU (zeros of the same shape and dtype)."""
    from torch.utils._pytree import tree_map_only

    with unset_fake_temporarily():
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), value)
