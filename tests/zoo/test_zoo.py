"""The model zoo's CI subset: real models, unchanged, trained on 2 CPU ranks like one rank.

Each case takes one zoo model file (examples/zoo/), asks autopar whether it offers the dimension, runs
the tiny size 3 steps under a 2-rank plan of that dimension with ``autopar run`` and compares every
step's loss and each parameter's first-step gradient norm (``--grad-norms``) with the same model on
one rank (benchmarks/zoo_lib.py, shared with
benchmarks/model_zoo.py, which runs the whole matrix). Hugging Face cases skip without transformers.
"""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import zoo_lib  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.dist]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _xfail(reason: str):
    # Temporary: a known autopar failure that its fix flips; strict, so the fix must remove the mark.
    return pytest.mark.xfail(strict=True, reason=reason)


# (model, run cell, the support keys the case requires offered). "tp2+sp" runs tp2 without SP where SP
# is not offered; a case that lists "sp" requires it.
CASES = [
    # HF Llama under tp2 + SP and pp2 x tp2 + SP: tests/dist/test_hf_models.py
    pytest.param("hf_gemma2", "pp2", ("pp",), id="hf_gemma2-pp2"),  # masks picked by loop position
    pytest.param("hf_deepseek_v3", "pp2", ("pp",), id="hf_deepseek_v3-pp2"),  # dense then MoE blocks in one list
    pytest.param("hf_clip", "pp2", ("pp",), id="hf_clip-pp2"),  # a tower's output carried to the loss
    pytest.param("hf_swin", "pp2", ("pp",), id="hf_swin-pp2"),  # the encoder reads stage.downsample
    # HF GPT-2 (Conv1D layers) under tp 2 and tp 2 + SP, the zoo's file against one process:
    # tests/dist/test_tp_foreign.py (hf-gpt2-tp2, hf-gpt2-tp2-sp)
    pytest.param("hf_falcon", "tp2+sp", ("tp",), id="hf_falcon-tp2"),  # += on a row-parallel output
    # the zoo's ViT under pp 2 against one process: tests/dist/test_chain_models.py (vit-pp2; also dp2, zero3)
    pytest.param("resnet", "pp2", ("pp",), id="resnet-pp2"),
    pytest.param("torch_encoder", "pp2", ("pp",), id="torch_encoder-pp2"),  # TransformerEncoder reads layers[0]
    pytest.param("hf_bert", "tp2+sp", ("tp", "sp"), id="hf_bert-tp2+sp"),  # post-LN under SP, a tied bias
    pytest.param("hf_qwen2", "cp2", ("cp",), id="hf_qwen2-cp2"),  # a dict of input_ids and labels, output.loss
    # blocks of two structures in one list, a tp plan per unit kind (spec/chain_tp.py), SP where each
    # kind passes its check (DeepSeek's MLA: its replicated q_a/kv_a projections and norms on whole,
    # gathered inputs, spec/tp_replicated.py):
    # ModernBERT's plans inferred (layer 0 has no attention norm), DeepSeek-V3's from HF's _tp_plan
    # (dense layers' MLP, MoE layers' shared experts; the routed experts replicated)
    pytest.param("hf_modernbert", "tp2+sp", ("tp", "sp"), id="hf_modernbert-tp2+sp"),
    pytest.param("hf_deepseek_v3", "tp2+sp", ("tp", "sp"), id="hf_deepseek_v3-tp2+sp"),
    # TP inferred for unusual names: test_tp_is_inferred_for_unusual_module_names (the plan; inferred
    # plans train in hf_gpt2/hf_falcon/hf_modernbert above); MoE under data
    # parallelism and ep: tests/dist/test_expert_parallel.py
    # HF models trained through labels at tp 2 + SP (GLM-4, Cohere, MPT): tests/dist/test_hf_label_loss.py, one spawn
    # the head multiplies by the input embedding's weight (h @ embeddings.weight.T): that prologue module is
    # shared, real on the last stage (spec/pipeline_probe.py)
    pytest.param("hf_perceiver", "pp2", ("pp",), id="hf_perceiver-pp2"),
    # the cross-attention before the blocks has a Linear as wide as the position table: only a module
    # after the blocks can be the vocabulary head (spec/vocab_edges.py)
    pytest.param("hf_perceiver", "tp2+sp", ("tp",), id="hf_perceiver-tp2"),
    # experts called with rows grouped by expert and the rows per expert (spec/moe.py's grouped call)
    pytest.param("hf_jetmoe", "ep2", ("ep",), id="hf_jetmoe-ep2"),
    # blocks in a numbered nn.ModuleDict run over values() (torchtitan's layers): a chunk's dict of markers
    # and blocks (autopar/block_dict.py, pipeline_parallel._ChunkBlockDict)
    pytest.param("torch_titan_llama", "pp2", ("pp",), id="torch_titan_llama-pp2"),
    # an integer tensor (ViTMAE's restore indices) carried to the last stage: torch's shape inference runs
    # that stage on uninitialised inputs first (pipeline_parallel.StageModule.forward)
    pytest.param("hf_vit_mae", "pp2", ("pp",), id="hf_vit_mae-pp2"),
]


def _prepare(name: str, work: Path, env: dict[str, str] | None = None) -> dict:
    """A model's tiny copy, what autopar offers and the one-rank losses (both from one child,
    zoo_lib.support_and_reference, in ``env``: default this process's environment now). ZooError
    when autopar cannot say what it offers."""
    tiny = zoo_lib.with_size(zoo_lib.zoo_models([name])[0].path, "tiny", work)
    support, reference = zoo_lib.support_and_reference(tiny, work, env=env)
    return {"tiny": tiny, "work": work, "support": support, "reference": reference}


def prepared_ahead(items: list) -> list[str]:
    """The models ``_prepare`` can start on ahead for the selected ``items`` (pytest items), in the
    order their run cases come: tests/zoo/conftest.py starts on them when the session's collection
    ends, one child at a time in a thread, while the tests before the zoo's run (a child is one
    process; most of those tests leave a core idle), and puts each model's Future in ``AHEAD``. Its
    children get the environment of the collection's end, not what a test running then may have set
    (monkeypatch.setenv)."""
    names: list[str] = []
    for item in items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) != "test_zoo_model_trains_like_one_rank" or spec is None:
            continue
        name = spec.params["name"]
        if name not in names and not zoo_lib.zoo_models([name])[0].missing() and (
                HAS_TRANSFORMERS or not name.startswith("hf_")):
            names.append(name)
    return names


AHEAD: dict[str, Future] = {}  # model -> _prepare's answer, started by tests/zoo/conftest.py


@pytest.fixture(scope="module")
def zoo_state(tmp_path_factory):
    """Per model, computed once: ``_prepare``'s answer, the one started ahead (``AHEAD``) when there
    is one. Each case still waits for its own model's answer."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            model = zoo_lib.zoo_models([name])[0]
            if model.missing():
                pytest.skip(model.missing())
            cache[name] = AHEAD[name].result() if name in AHEAD else _prepare(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.mark.parametrize(("name", "dim", "needs"), CASES)
def test_zoo_model_trains_like_one_rank(zoo_state, name, dim, needs):
    if name.startswith("hf_") and not HAS_TRANSFORMERS:
        pytest.skip("transformers not installed")
    state = zoo_state(name)
    support = state["support"]
    missing = [k for k in needs if support.reason(k) is not None]
    assert not missing, f"autopar does not offer {missing[0]} for {name}: {support.reason(missing[0])}"
    cell = zoo_lib.run_cell(state["tiny"], support, dim, state["reference"], state["work"])
    assert cell.status == "ok", f"{name} {dim}: {cell}\n{cell.tail}"


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")
# DeepSeek: a chain of differing blocks; Jamba: Mamba layers whose reference scan loops over the 4,096
# positions, measured at a shorter sequence and extrapolated (graph/short_probe.py)
@pytest.mark.parametrize("name", ["hf_llama", "hf_deepseek_v3", "hf_jamba"])
def test_zoo_full_size_plans_at_64_gpus(tmp_path, name):
    cell = zoo_lib.plan_cell(zoo_lib.zoo_models([name])[0].path, tmp_path, gpus=64)
    assert cell.status == "ok", f"{cell}\n{cell.tail}"
    assert (tmp_path / f"{name}-64gpu.yaml").is_file()


# ---- the zoo's own machinery (no processes) --------------------------------------------------------
def test_every_zoo_file_has_a_tiny_and_a_full_size_and_declares_nothing():
    models = zoo_lib.zoo_models()
    assert len(models) >= 17
    for m in models:
        text = m.path.read_text(encoding="utf-8")
        assert 'SIZE = "tiny"' in text and '"full"' in text, m.name
        for declaration in ("tp_plan =", "pipeline_blocks ="):
            assert declaration not in text, f"{m.name} declares {declaration!r}; the zoo must need none"


def test_with_size_rewrites_only_the_size_line(tmp_path):
    src = zoo_lib.zoo_models(["vit"])[0].path
    full = zoo_lib.with_size(src, "full", tmp_path)
    a, b = src.read_text().splitlines(), full.read_text().splitlines()
    assert [i for i, (x, y) in enumerate(zip(a, b)) if x != y] == [a.index('SIZE = "tiny"')]
    assert b[a.index('SIZE = "tiny"')] == 'SIZE = "full"'


def test_compare_losses_is_relative_and_per_step():
    assert zoo_lib.compare_losses([5.0, 4.0], [5.0 * (1 + 5e-5), 4.0]) is None
    assert "step 2" in zoo_lib.compare_losses([5.0, 4.0], [5.0, 4.001])
    assert "2 losses" in zoo_lib.compare_losses([5.0, 4.0, 3.0], [5.0, 4.0])


def test_one_line_cause_is_the_first_error_that_is_not_a_peer_failing():
    assert zoo_lib.one_line_cause("x\nautopar: error: parallel.tp = 2 does not divide 25 heads\n", 2) == (
        "parallel.tp = 2 does not divide 25 heads")
    out = ("autopar: error: rank 0 in step 1: a collective lost a peer\n[rank1]: Traceback\n"
           "[rank1]: KeyError: 'embed_tokens.weight'\ntorch.distributed.elastic.ChildFailedError: x\n")
    assert zoo_lib.one_line_cause(out, 1) == "KeyError: 'embed_tokens.weight'"
    assert "lost a peer" in zoo_lib.one_line_cause("autopar: error: rank 0: a collective lost a peer\n", 4)
    assert zoo_lib.one_line_cause("", 1) == "exit 1: no output"


def test_table_gives_every_cell_a_result_or_a_numbered_reason_and_fails_on_any_failure():
    import model_zoo

    m = zoo_lib.zoo_models(["vit"])[0]
    ok, na = zoo_lib.Cell(status="ok"), zoo_lib.Cell(status="n/a", detail="no tp plan", expected=True)
    fail = zoo_lib.Cell(status="FAIL", detail="KeyError: 'cls_token'", tail="Traceback ...")
    result = zoo_lib.ModelResult(
        model=m, plan=zoo_lib.Cell(status="ok", detail="3.0 s", seconds=3.0), support=None,
        support_cells={"tp": na, "sp": na, "pp": ok, "cp": zoo_lib.Cell(status="n/a", detail="no SEQ_LEN"), "zero3": ok,
                       "ep": zoo_lib.Cell(status="n/a", detail="no experts")},
        runs={"dp2": ok, "pp2": fail})
    table = model_zoo.format_table([result], ["dp2", "pp2"])
    row = next(line for line in table.splitlines() if line.startswith("vit"))
    assert row.split() == ["vit", "3.0", "s", "n/a*[1]", "n/a*[1]", "ok", "n/a[2]", "ok", "n/a[3]", "ok", "FAIL[4]"]
    assert "[4] FAIL: KeyError: 'cls_token'" in table and "[1] n/a: no tp plan" in table
    line, failures = model_zoo.summary([result])
    assert failures == 1 and "2 expected offers missing" in line and "vit" in line
    assert model_zoo.summary([result], strict_offers=True)[1] == 3
    log = model_zoo.failure_log([result])
    assert "### vit — run:pp2: KeyError: 'cls_token'" in log and "Traceback ..." in log


# ---- the TP plan autopar uses for zoo models that declare none (in-process: model_spec on meta) -----
def _spec(name: str):
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    return model_spec(load_model_file(zoo_lib.zoo_models([name])[0].path))


@pytest.mark.parametrize("name", ["autopar_gpt", "autopar_llama"])
def test_reference_models_without_a_tp_plan_line_get_their_declared_plan(name):
    from autopar.models.gpt import GPT_TP_PLAN
    from autopar.models.llama import LLAMA_TP_PLAN

    spec = _spec(name)
    assert dict(spec.tp.styles) == {"autopar_gpt": GPT_TP_PLAN, "autopar_llama": LLAMA_TP_PLAN}[name]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")
@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_hf_models_get_hf_own_tp_plan(name):
    import transformers

    spec = _spec(name)
    cfg_cls = {"hf_llama": transformers.LlamaConfig, "hf_qwen2": transformers.Qwen2Config}[name]
    expected = {k.split(".*.", 1)[1]: v for k, v in cfg_cls.base_model_tp_plan.items() if v in ("colwise", "rowwise")}
    assert spec.tp.source == "model"
    assert dict(spec.tp.styles) == expected


def test_tp_is_inferred_for_unusual_module_names():
    spec = _spec("odd_names_decoder")
    assert dict(spec.tp.styles) == {
        "mix.query": "colwise", "mix.keyval": "colwise", "mix.out": "rowwise",
        "ffw.gate": "colwise", "ffw.up": "colwise", "ffw.down": "rowwise",
    }
