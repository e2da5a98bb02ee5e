"""The vocab-parallel embedding's lookup on each rank's own rows (executor/parallel/tp_vocab_lookup.py),
on 2 gloo ranks against one process's ``nn.Embedding``: the same output, the same gradient, and a
backward that never makes a whole-vocabulary tensor (DTensor's own lookup computes the weight's
gradient for every row on every rank)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

VOCAB, DIM, WORLD = 16, 4, 2


class _ScaledEmbedding(nn.Embedding):
    """A model's own embedding subclass around the lookup (Gemma's scaled embedding)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return super().forward(input) * 3.0


def _modules() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"plain": nn.Embedding(VOCAB, DIM), "padded": nn.Embedding(VOCAB, DIM, padding_idx=11),
            "scaled": _ScaledEmbedding(VOCAB, DIM),
            "by_freq": nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)}  # keeps DTensor's lookup


def _ids() -> torch.Tensor:
    return torch.tensor([[0, 3, 8, 11, 15, 3], [7, 8, 9, 11, 2, 14]])


def _reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    module = _modules()[name]
    ids = _ids()
    out = module(ids)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), module.weight.grad.detach()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A collective's result (an AsyncCollectiveTensor) as a plain tensor, waited for."""
    t = t.detach()
    return (t.wait() if hasattr(t, "wait") else t).clone()


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from harness import gloo_rank
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.executor.parallel import tp_vocab_lookup

    class Rows(TorchDispatchMode):
        """The rows of every embedding_dense_backward (its num_weights argument)."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is torch.ops.aten.embedding_dense_backward.default:
                self.rows.append(int(args[2]))
            return func(*args, **(kwargs or {}))

    with gloo_rank(rank, world, port):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        results = {}
        for name, module in _modules().items():
            parallelize_module(module, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
            installed = tp_vocab_lookup.install(module)
            out = module(_ids())
            rows = Rows()
            with rows:
                (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
            grad = module.weight.grad
            assert isinstance(grad, DTensor)
            results[name] = {"installed": installed, "out": _plain(out), "rows": rows.rows,
                             "sharded": tuple(grad.placements) == (Shard(0),),
                             "grad": _plain(grad.redistribute(mesh, [Shard(0)]).full_tensor()),
                             "local_rows": grad.to_local().shape[0]}
        if rank == 0:
            torch.save(results, Path(out_dir) / "result.pt")


@pytest.fixture(scope="module")
def ranks() -> dict:
    import harness

    with tempfile.TemporaryDirectory(prefix="autopar-vocab-") as out_dir:
        harness.spawn_again_on_abort(_worker, WORLD, out_dir)
        return torch.load(Path(out_dir) / "result.pt")


@pytest.mark.parametrize("name", ["plain", "padded", "scaled"])
def test_local_lookup_matches_one_process(ranks: dict, name: str) -> None:
    got = ranks[name]
    out, grad = _reference(name)
    assert got["installed"]
    torch.testing.assert_close(got["out"], out)
    torch.testing.assert_close(got["grad"], grad)
    # backward made only this rank's rows, never the whole vocabulary
    assert got["rows"] == [VOCAB // WORLD] and got["local_rows"] == VOCAB // WORLD and got["sharded"]


def test_options_that_need_dtensors_lookup_keep_it(ranks: dict) -> None:
    got = ranks["by_freq"]
    assert not got["installed"]
    # negative control: DTensor's own lookup differentiates every row of the vocabulary
    assert got["rows"] == [VOCAB] and not got["sharded"]
    out, grad = _reference("by_freq")
    torch.testing.assert_close(got["grad"], grad)
