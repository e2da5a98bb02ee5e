"""Model files (docs/design.md §3, a contract): loading on meta, declarations, and one-line errors naming the file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from autopar.errors import ModelFileError
from autopar.graph import build_graph
from autopar.modelfile import call_model, load_model_file

MODELS = Path(__file__).resolve().parents[1] / "data" / "models"


def _load_build_trace(path: Path) -> None:
    """Everything the planner does with a model file: import, build on meta, inputs, trace the graph."""
    mf = load_model_file(path)
    mf.build("meta")
    mf.example_inputs(1, "meta")
    build_graph(mf, dtype="fp32")


# (file, a substring of the cause the message must contain)
BAD_MODEL_FILES = [
    ("does_not_exist.py", "does not exist"),
    ("not_python.txt", ".py"),
    ("syntax_error.py", "SyntaxError"),
    ("import_error.py", "autopar_no_such_module_xyz"),
    ("raises_at_import.py", "weights not found"),
    ("exits_at_import.py", "exit(3)"),
    ("no_build_model.py", "build_model"),
    ("no_example_inputs.py", "example_inputs"),
    ("not_a_module.py", "torch.nn.Module"),
    ("build_fails_on_meta.py", "build_model() failed on meta"),
    ("example_inputs_fails.py", "dataset shard"),
    ("forward_fails_on_meta.py", "meta"),
    ("no_blocks.py", "pipeline_blocks"),
    ("bad_seq_len.py", "SEQ_LEN"),
    ("bad_tp_plan.py", "diagonal"),
    ("loss_not_callable.py", "loss_fn"),
]


@pytest.mark.parametrize("name,cause", BAD_MODEL_FILES, ids=[n for n, _ in BAD_MODEL_FILES])
def test_bad_model_file_is_one_line_error_naming_the_file(name: str, cause: str) -> None:
    with pytest.raises(ModelFileError) as info:
        _load_build_trace(MODELS / name)
    msg = str(info.value)
    assert "\n" not in msg, f"multi-line error: {msg!r}"
    assert name in msg, f"error does not name the file: {msg}"
    assert cause in msg, f"error does not give the cause {cause!r}: {msg}"


@pytest.mark.parametrize("name,cause", [("bad_pipeline_blocks.py", "decoder.layers"),
                                        ("no_output_tensor.py", "loss_fn")])
def test_trace_errors_name_the_file(name: str, cause: str) -> None:
    with pytest.raises(ModelFileError) as info:
        _load_build_trace(MODELS / name)
    msg = str(info.value)
    assert "\n" not in msg and cause in msg
    assert name in msg, f"error does not name the file: {msg}"


def test_at_least_ten_kinds_of_bad_model_file() -> None:
    assert len(BAD_MODEL_FILES) >= 10


def test_example_gpt_loads_on_meta_with_its_declarations(repo: Path) -> None:
    path = repo / "examples" / "gpt.py"
    mf = load_model_file(path)
    assert mf.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert mf.seq_len == 2048 and mf.pipeline_blocks == "layers"
    assert mf.tp_plan == {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    assert callable(mf.loss_fn)
    model = mf.build()  # GPT-3 175B: on meta it costs no memory
    params = list(model.parameters())
    assert all(p.device.type == "meta" for p in params)
    assert 174e9 < sum(p.numel() for p in params) < 176e9
    tokens = mf.example_inputs(3)
    assert tokens.device.type == "meta" and tuple(tokens.shape) == (3, 2048) and tokens.dtype == torch.int64


def test_inputs_are_passed_as_the_contract_says() -> None:
    class Probe(torch.nn.Module):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003
            return args, kwargs

    probe = Probe()
    t = torch.zeros(1)
    assert call_model(probe, t) == ((t,), {})
    assert call_model(probe, (t, t)) == ((t, t), {})
    assert call_model(probe, {"x": t}) == ((), {"x": t})


def test_each_load_is_a_fresh_module(tmp_path: Path) -> None:
    path = tmp_path / "counter.py"
    path.write_text("import torch\nCALLS = []\ndef build_model():\n    CALLS.append(1)\n    return torch.nn.Linear(2, 2)\n"
                    "def example_inputs(n):\n    return torch.zeros(n, 2)\n")
    a, b = load_model_file(path), load_model_file(path)
    a.build()
    assert a.module is not b.module and a.module.CALLS == [1] and b.module.CALLS == []


def test_non_sequence_model_without_declarations(repo: Path) -> None:
    mf = load_model_file(repo / "examples" / "mlp.py")
    assert mf.seq_len is None and mf.tp_plan is None and mf.pipeline_blocks == "blocks" and callable(mf.loss_fn)
    x = mf.example_inputs(4)
    assert x.device.type == "meta" and tuple(x.shape) == (4, 256)


_LEGACY_PARAMETERS = '''
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.FloatTensor(8, 2, 4))  # a legacy constructor: on the CPU whatever the device
        self.o = self.q  # the same parameter twice


def build_model():
    return nn.Sequential(nn.Linear(8, 8), Attention())


def example_inputs(micro_batch_size):
    return torch.zeros(micro_batch_size, 8)
'''


def test_a_parameter_a_legacy_constructor_makes_on_the_cpu_is_on_meta_in_a_meta_build(tmp_path: Path) -> None:
    # HF XLNet builds its attention weights with torch.FloatTensor(...): a CPU tensor of garbage inside
    # the meta model, and its forward on meta mixed devices ("Tensor on device meta is not on the
    # expected device cpu")
    path = tmp_path / "legacy_parameters.py"
    path.write_text(_LEGACY_PARAMETERS, encoding="utf-8")
    model = load_model_file(path).build("meta")
    assert all(p.is_meta for p in model.parameters())
    assert model[1].q is model[1].o  # a parameter registered twice stays one parameter
    assert load_model_file(path).build("cpu")[1].q.device.type == "cpu"  # other devices: as built


FOLDED_ROWS = '''
import torch
from torch import nn

SEQ_LEN = 8


def build_model():
    return nn.Embedding(16, 4)


def example_inputs(micro_batch_size):
    # four codebook rows per sample folded into dim 0, as MusicGen's decoder takes them
    return torch.zeros(micro_batch_size * 4, SEQ_LEN, dtype=torch.long)


def loss_fn(output, inputs):
    return output.sum()
'''


def test_rows_folded_into_the_batch_are_refused_with_how_to_unfold_them(tmp_path: Path) -> None:
    from autopar.modelcheck import check_example_inputs

    path = tmp_path / "folded.py"
    path.write_text(FOLDED_ROWS, encoding="utf-8")
    with pytest.raises(ModelFileError) as info:
        check_example_inputs(load_model_file(str(path)))
    msg = str(info.value)
    assert "\n" not in msg and "dim 0 must be the micro-batch size" in msg
    assert "4 rows per sample" in msg and "[1, 4, 8]" in msg
