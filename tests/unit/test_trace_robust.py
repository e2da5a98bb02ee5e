"""Tracing on meta never hangs and copes with common model code: ``torch.tensor`` in a forward
(its ``lift_fresh`` returns its input), value reads and data-dependent shapes answered on meta,
and a time limit that ends a tracing which cannot finish with one line (exit 2)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autopar.errors import AutoparError, ModelFileError
from autopar.graph.measure import build_graph
from autopar.graph.time_limit import ENV_VAR, measure_time_limit
from autopar.graph.trace import run_and_trace
from autopar.spec.meta import tolerant_meta

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "models"

_TINY = '''
import torch
import torch.nn.functional as F
from torch import nn

SEQ_LEN = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
{body}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def build_model():
    return Model()


def example_inputs(micro_batch_size):
    return torch.randint(0, 32, (micro_batch_size, SEQ_LEN))
'''


def _model(tmp_path: Path, name: str, body: str, extra: str = "") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(_TINY.format(body=body) + extra)
    return path


def _block_flops(graph) -> float:
    return sum(op.flops for op in graph.regions["block"].ops)


def test_torch_tensor_in_forward_traces(tmp_path) -> None:
    """``torch.tensor(...)`` in a block used to loop the tracer's view map forever (lift_fresh)."""
    plain = build_graph(str(_model(tmp_path, "plain", "        return self.lin(x) * 2.0")), time_limit_s=60)
    lifted = build_graph(str(_model(tmp_path, "lifted", "        return self.lin(x) * torch.tensor(2.0)")),
                         time_limit_s=60)
    assert _block_flops(lifted) == pytest.approx(_block_flops(plain)) and _block_flops(plain) > 0


def test_ops_returning_their_input_do_not_loop_the_view_map() -> None:
    x = torch.randn(4, 4, device="meta", requires_grad=True)

    def fn(set_region) -> None:
        set_region("block")
        t = torch.ops.aten.lift_fresh(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # returns its input
        v = x.view(16).view(4, 4)  # a view of a view
        a = torch.ops.aten.alias(v)
        y = (a * t.to("meta")).sum() + torch.ops.aten.lift_fresh(torch.tensor(1.0)).to("meta")
        set_region("bwd:block")
        y.backward()

    with measure_time_limit("view-map test", limit_s=20):
        trace = run_and_trace(fn, iter([x]))
    assert any(op.name == "mul" for op in trace.ops)


def test_data_dependent_code_runs_on_meta() -> None:
    """Non-routing masks are taken as all nonzero (no padding), value reads as 0 / False."""
    with tolerant_meta():
        mask = torch.ones(2, 8, dtype=torch.bool, device="meta")
        assert torch.nonzero(mask).shape == (16, 2)
        rows, cols = torch.where(mask)
        assert rows.shape == (16,)
        assert torch.masked_select(torch.empty(2, 8, device="meta"), mask).shape == (16,)
        assert not bool(mask.any()) and mask.sum().item() == 0
        h = torch.empty(2, 8, 5, device="meta")
        assert h[mask].shape == (16, 5)  # boolean-mask indexing (its meta kernel would call nonzero)
        h[mask] = torch.zeros(16, 5, device="meta")
        with pytest.raises(NotImplementedError, match="minlength"):
            torch.bincount(torch.empty(8, dtype=torch.long, device="meta"))


def test_top_k_routing_is_balanced_on_meta() -> None:
    tokens, experts, k = 32, 4, 2
    with tolerant_meta() as mode:
        scores = torch.empty(tokens, experts, device="meta")
        _, idx = torch.topk(scores, k, dim=-1)
        assert mode.routing is not None and (mode.routing.tokens, mode.routing.top_k) == (tokens, k)
        for e in range(experts):
            mask = idx == e
            assert bool(mask.any())  # an expert has tokens
            tok, slot = torch.where(mask)
            assert tok.shape == (tokens * k // experts,)
            assert torch.nonzero(mask.any(-1)).shape[0] == tokens * k // experts
        assert torch.bincount(idx.flatten()).shape == (experts,)
        assert idx.max().item() == experts - 1  # the largest expert id, not a count
        x = torch.empty(tokens, 8, device="meta")
        assert x[(idx == 1).any(-1)].shape == (tokens * k // experts, 8)
        hit = (torch.nn.functional.one_hot(idx, num_classes=experts + 1).sum(dim=(0, 1)) > 0).nonzero()
        assert hit.shape[0] == experts


def test_grouped_mm_runs_on_meta_in_fp32() -> None:
    a = torch.empty(12, 8, device="meta")
    b = torch.empty(3, 8, 5, device="meta")
    offs = torch.empty(3, dtype=torch.int32, device="meta")
    with tolerant_meta():
        out = torch._grouped_mm(a, b, offs=offs)
    assert out.shape == (12, 5) and out.dtype == torch.float32


def test_time_limit_restores_the_previous_handler_and_timer() -> None:
    def mine(signum, frame) -> None:  # noqa: ANN001
        raise AssertionError("the caller's handler ran early")

    old = signal.signal(signal.SIGALRM, mine)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        prof = signal.getsignal(signal.SIGPROF)
        with measure_time_limit("x.py", limit_s=5) as clock:
            clock.stage("probing")
            assert 0 < signal.getitimer(signal.ITIMER_PROF)[0] <= 5.05  # CPU time (timer granularity)
            assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 25.05  # the wall-clock backstop, 5x
        assert signal.getsignal(signal.SIGALRM) is mine and signal.getsignal(signal.SIGPROF) is prof
        assert signal.getitimer(signal.ITIMER_PROF)[0] == 0
        assert 20.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_time_limit_ends_a_loop_with_one_line_naming_the_stage() -> None:
    start = time.monotonic()
    with pytest.raises(ModelFileError) as info:
        with measure_time_limit("m.py", limit_s=0.5) as clock:
            clock.stage("tracing")
            while True:
                pass
    assert time.monotonic() - start < 5
    msg = str(info.value)
    assert msg.startswith("m.py: tracing the model") and "0.5 s" in msg and ENV_VAR in msg and "\n" not in msg


def test_bad_time_limit_is_a_user_error(monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, "soon")
    with pytest.raises(AutoparError, match=ENV_VAR):
        with measure_time_limit("m.py"):
            pass


def test_a_loss_that_never_returns_ends_in_the_tracing_stage(tmp_path) -> None:
    path = _model(tmp_path, "loss_loops", "        return self.lin(x)",
                  "\n\ndef loss_fn(output, inputs):\n    while True:\n        pass\n")
    start = time.monotonic()
    with pytest.raises(ModelFileError, match=r"tracing the model on the meta device did not finish within 2 s of CPU time"):
        build_graph(str(path), time_limit_s=2)
    assert time.monotonic() - start < 30


def test_plan_of_a_model_that_loops_forever_exits_2_with_one_line() -> None:
    env = dict(os.environ, **{ENV_VAR: "3"}, PYTHONPATH=str(REPO))
    model = DATA / "loops_forever.py"
    proc = subprocess.run([sys.executable, "-m", "autopar", "plan", str(model), "--gpus", "8"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("autopar: error: ") and str(model) in lines[0]
    # the forward loops while the structure is probed; on a loaded machine building may use up the 3 s
    assert re.search(r": (building the model|probing the model's structure) \(?.*on the meta device did not "
                     r"finish within 3 s of CPU time; .* raise " + ENV_VAR, lines[0]), lines[0]
    assert proc.stdout == ""


def test_a_wait_that_uses_no_cpu_ends_by_the_wall_clock() -> None:
    with pytest.raises(ModelFileError, match=r"probing the model's structure on the meta device did not finish "
                                             r"within 1 s;"):
        with measure_time_limit("m.py", limit_s=0.2) as clock:
            clock.stage("probing")
            time.sleep(30)


_HF = '''
import torch
import transformers

CONFIG = transformers.{config}(**{kwargs!r})
SEQ_LEN = 32


def build_model():
    return transformers.{model}(CONFIG)


def example_inputs(micro_batch_size):
    ids = torch.randint(4, CONFIG.vocab_size, (micro_batch_size, SEQ_LEN))
    return {inputs}


def loss_fn(output, inputs):
    return output.loss if getattr(output, "loss", None) is not None else output.logits.float().mean()
'''
_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, use_cache=False)
HF_CASES = {
    # use_cache=False, the training setting, once hit a .item() on meta (HF's packed-sequence check)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_SMALL, num_key_value_heads=2), "ids"),
    # a sliding window shorter than the sequence: the mask really cuts
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_SMALL, num_key_value_heads=2, sliding_window=16), "ids"),
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      dict(_SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                           max_window_layers=0), "ids"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_SMALL, num_key_value_heads=2, pad_token_id=0), "ids"),
    "bert": ("BertConfig", "BertForMaskedLM", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4), "ids"),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                  use_cache=False), '{"input_ids": ids, "labels": ids}'),
}


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_hf_models_trace_on_meta(tmp_path, name) -> None:
    """Hugging Face models from configs trace, and their block's FLOPs are its Linear layers' (2 per
    weight per token) plus attention (at most 2 x 4 s d per token: self- and cross-attention)."""
    pytest.importorskip("transformers")
    config, model, kwargs, inputs = HF_CASES[name]
    path = tmp_path / f"hf_{name}.py"
    path.write_text(_HF.format(config=config, model=model, kwargs=kwargs, inputs=inputs))
    graph = build_graph(str(path))
    from autopar.modelfile import load_model_file
    from autopar.spec import model_spec

    mf = load_model_file(path)
    spec = model_spec(mf)
    block = mf.build("meta").get_submodule(spec.blocks_path)[0]
    linear = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    d, s = 64, 32
    per_token = sum(op.flops for op in graph.regions["block"].ops if op.phase == "fwd") / s
    assert 2 * linear * 0.99 <= per_token <= (2 * linear + 2 * 4 * s * d) * 1.02


def test_unique_and_repeat_interleave_of_routing_on_meta() -> None:
    tokens, experts, k = 32, 4, 2
    with tolerant_meta():
        _, idx = torch.topk(torch.empty(tokens, experts, device="meta"), k, dim=-1)
        hit, counts = torch.unique(idx, return_counts=True)
        assert hit.shape == (experts,) and counts.shape == (experts,)
        assert counts.cpu().tolist() == [tokens * k // experts] * experts
        owner = torch.repeat_interleave(torch.arange(experts, device="meta"), counts)
        assert owner.shape == (tokens * k,)
        assert torch.empty(3, 5, device="meta").repeat_interleave(2, dim=0).shape == (6, 5)  # static: as torch
        assert torch.unique(torch.empty(7, dtype=torch.long, device="meta")).shape == (7,)


def test_a_build_model_that_never_returns_ends_in_the_building_stage(tmp_path) -> None:
    """build_model() runs inside the model-file guard (autopar.usercode), which reports what the
    user's code raised; the time limit's interrupt is still reported as the time limit."""
    path = _model(tmp_path, "build_loops", "        return self.lin(x)",
                  "\n\ndef build_model():\n    while True:\n        pass\n")
    with pytest.raises(ModelFileError, match=r"building the model \(build_model\(\)\) on the meta device did not "
                                             r"finish within 1 s of CPU time"):
        build_graph(str(path), time_limit_s=1)
