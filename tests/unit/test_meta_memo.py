"""The memo of meta kernels' output metadata (autopar/spec/meta_memo.py)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.spec import meta_memo
from autopar.spec.meta import call_on_meta

aten = torch.ops.aten


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device.type


def test_a_repeated_call_is_answered_from_the_memo_with_the_kernels_metadata():
    a = torch.empty(2, 3, 8, 8, device="meta").to(memory_format=torch.channels_last)
    b = torch.empty(8, device="meta", dtype=torch.bfloat16)
    want = aten.mul.Tensor(a, b)
    first = call_on_meta(aten.mul.Tensor, (a, b), {})
    key = meta_memo.memo_key(aten.mul.Tensor, (a, b), {})
    assert key is not None and meta_memo.lookup(key) is not None
    second = call_on_meta(aten.mul.Tensor, (a, b), {})
    assert _meta(first) == _meta(second) == _meta(want)  # channels-last strides and the promoted dtype kept
    assert second is not first


def test_the_key_tells_input_strides_dtypes_scalars_and_the_default_dtype_apart():
    a = torch.empty(4, 6, device="meta")
    keys = {
        meta_memo.memo_key(aten.add.Tensor, (a, a), {}),
        meta_memo.memo_key(aten.add.Tensor, (a.t(), a.t()), {}),
        meta_memo.memo_key(aten.add.Tensor, (a.half(), a.half()), {}),
        meta_memo.memo_key(aten.add.Tensor, (a, a), {"alpha": 2}),
        meta_memo.memo_key(aten.add.Tensor, (a, a), {"alpha": 2.0}),
    }
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        keys.add(meta_memo.memo_key(aten.add.Tensor, (a, a), {}))
    finally:
        torch.set_default_dtype(old)
    assert None not in keys and len(keys) == 6
    out = call_on_meta(aten.add.Tensor, (a.t(), a.t()), {})
    assert out.shape == (6, 4) and out.stride() == aten.add.Tensor(a.t(), a.t()).stride()


def test_views_writes_real_tensors_and_outputs_that_are_inputs_are_not_memoised():
    a = torch.empty(4, 6, device="meta")
    assert meta_memo.memo_key(aten.view.default, (a, [24]), {}) is None  # returns an alias
    assert meta_memo.memo_key(aten.add_.Tensor, (a, a), {}) is None  # writes its input
    assert meta_memo.memo_key(aten.add.Tensor, (torch.zeros(2), torch.zeros(2)), {}) is None  # not meta
    weight = torch.nn.Parameter(torch.empty(6, device="meta"))  # a norm's weight times the hidden state
    assert meta_memo.memo_key(aten.mul.Tensor, (a, weight), {}) is not None
    key = ("probe", 1)
    meta_memo.remember(key, (a,), {}, a)  # an op that hands back its input
    assert meta_memo.lookup(key) is None
    unsafe = (aten._unsafe_view.default, (a, [24]), {})  # a view its schema does not declare
    call_on_meta(*unsafe)
    key = meta_memo.memo_key(*unsafe)
    assert key is not None and meta_memo.lookup(key) is None


def test_no_memo_while_another_dispatch_mode_would_see_the_op():
    seen: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            seen.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    a = torch.empty(3, 5, device="meta")
    call_on_meta(aten.sigmoid.default, (a,), {})  # memoised with no mode active
    with Watch():
        assert meta_memo.memo_key(aten.sigmoid.default, (a,), {}) is None
    assert meta_memo.memo_key(aten.sigmoid.default, (a,), {}) is not None


def test_a_full_memo_is_cleared_not_grown(monkeypatch):
    monkeypatch.setattr(meta_memo, "MAX_ENTRIES", 2)
    monkeypatch.setattr(meta_memo, "_MEMO", {})
    a = torch.empty(2, device="meta")
    for n in range(5):
        call_on_meta(aten.mul.Tensor, (a, float(n) + 0.5), {})
    assert 1 <= len(meta_memo._MEMO) <= 2
