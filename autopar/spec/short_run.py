"""One meta forward of a model with its middle blocks answered from a neighbour's output.

The spec reads, from a forward of the whole model on meta: how block 0 is called, what the last
block returns, which modules run before and after the blocks, the data flow inside block 0 (TP
inference) and the router's top-k. None of it needs the blocks between the second and the last
to compute: on meta nothing has a value, and repeated blocks map their input to an output of the
same structure. So blocks 2..L-2 return block 1's output object as their own, and a forward of
GPT-3's 96 blocks costs that of four (the spec of a large model was ~1.8 s of CPU per forward).
Blocks 0, 1 and L-1 run their real code. A middle block called before block 1 has run (a model
calling its blocks out of order) runs its real forward too."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

MIN_BLOCKS_TO_SHORTEN = 5  # with four blocks or fewer every block runs anyway


@contextlib.contextmanager
def _answered(source: nn.Module, answering: list[nn.Module]) -> Iterator[None]:
    """Within the context, each block of ``answering`` returns the object ``source`` last returned
    (its real forward until ``source`` has run); a block with the user's own instance-level forward
    is left alone. The forwards are restored after."""
    seen: dict[str, Any] = {}
    handle = source.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))
    patched = []
    for blk in answering:
        if "forward" in vars(blk):  # the user's own instance-level forward: leave it alone
            continue
        real = blk.forward

        def answered(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            return seen["out"] if "out" in seen else _real(*args, **kwargs)

        blk.forward = answered
        patched.append(blk)
    try:
        yield
    finally:
        handle.remove()
        for blk in patched:
            del blk.forward


@contextlib.contextmanager
def middle_blocks_answered(blocks: nn.Module) -> Iterator[None]:
    """Within the context, blocks[2:-1] of the ModuleList/Sequential ``blocks`` return the
    object block 1 last returned (see the module docstring); their forwards are restored after."""
    n = len(blocks)
    if n < MIN_BLOCKS_TO_SHORTEN:
        yield
        return
    with _answered(blocks[1], [blocks[i] for i in range(2, n - 1)]):
        yield


@contextlib.contextmanager
def only_unit_runs(blocks: nn.Module, keep: nn.Module) -> Iterator[None]:
    """Within the context, every block of the list ``blocks`` but block 0 and ``keep`` returns the
    object block 0 last returned: a probe of one unit of a list of differing blocks (spec/chain_tp.py)
    reads only that unit's inputs and data flow, and a list of blocks that loop over the sequence in
    Python (a Mamba layer's reference scan) would otherwise run all of them for every probe. The
    caller falls back to the whole run where an answered block's object does not fit the model's
    code (blocks of different output structures)."""
    with _answered(blocks[0], [blk for blk in list(blocks.children())[1:] if blk is not keep]):
        yield
