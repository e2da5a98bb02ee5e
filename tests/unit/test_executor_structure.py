"""How the executor reads and cuts real module code, without processes (meta device): exact
full-model names, the pipeline probe (prologue stubs, tuple block outputs, bare parameters and the
phase that reads them), the SP hooks' input lookup, and the support the planner offers for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.executor.parallel import pipeline_parallel as pipe
from autopar.executor.parallel.apply import named_full, original_name
from autopar.modelfile import load_model_file
from autopar.spec import model_spec

MODELS = Path(__file__).resolve().parents[1] / "dist" / "models"
ZOO = Path(__file__).resolve().parents[2] / "examples" / "zoo"


def _chunks(path: Path, ranges: list[tuple[int, int]]):
    mf = load_model_file(path)
    model = mf.build("meta")
    spec = model_spec(mf, model)
    inputs = mf.example_inputs(1, "meta")
    probe = pipe.probe_structure(model, spec, inputs)
    io = pipe.StepIO(inputs)
    chunks = [pipe.build_chunk(model, spec, probe, r, index=i, num_chunks=len(ranges), io=io,
                               device=torch.device("cpu")) for i, r in enumerate(ranges)]
    return model, spec, probe, chunks


def test_a_network_under_model_keeps_its_names_on_pipeline_chunks() -> None:
    model, _, _, chunks = _chunks(MODELS / "under_model.py", [(0, 2), (2, 4)])
    full = {n for n, _ in model.named_parameters()}
    assert all(n.startswith("model.") for n in full)
    got = [{n for n, _ in named_full(c)} for c in chunks]
    assert got[0] | got[1] == full  # every parameter on some stage, under its own name
    assert "model.layers.0.attention.wq.weight" in got[0] and "model.output.weight" in got[1]
    # The stage's own attribute is removed only on a StageModule; a user's "model." never is.
    assert original_name("model.layers.0.attention.wq.weight", model) == "model.layers.0.attention.wq.weight"
    assert original_name(pipe.STAGE_PREFIX + "model.norm.weight", chunks[1]) == "model.norm.weight"


def test_bare_parameters_live_on_the_stages_that_read_them() -> None:
    _, _, probe, (first, last) = _chunks(MODELS / "bare_params_vit.py", [(0, 2), (2, 4)])
    assert probe.bare == {"cls_token": frozenset({"prologue"}), "pos_embed": frozenset({"prologue"}),
                          "logit_scale": frozenset({"epilogue"})}
    # its output reaches the blocks as gain=: computed once on the first stage and handed on
    assert probe.shared == () and probe.carried == ("gain",)
    assert type(last.chunk.gain).__name__ == "_Carried" and type(last.chunk.patch).__name__ == "_ZeroStub"
    params = [{n for n, _ in named_full(c)} for c in (first, last)]
    buffers = [{n for n, _ in named_full(c, buffers=True)} for c in (first, last)]
    assert {"cls_token", "pos_embed"} <= params[0] and "logit_scale" in buffers[0]
    assert "logit_scale" in params[1] and {"cls_token", "pos_embed"} <= buffers[1]
    # tuple block outputs: the receiving stage rebuilds (h, None) around the received activation
    assert probe.block_out.is_tensor == (True, False)
    inject = last.chunk.blocks.inject
    inject.value = torch.ones(2)
    out = inject()
    assert isinstance(out, tuple) and out[1] is None and torch.equal(out[0], torch.ones(2))


def test_hf_llama_stubs_only_the_embedding_and_runs_rotary_for_real() -> None:
    pytest.importorskip("transformers")
    _, spec, probe, (_, last) = _chunks(ZOO / "hf_llama.py", [(0, 2), (2, 4)])
    out, holds = probe.prologue["model.rotary_emb"]
    assert not holds and out.is_tensor == (True, True)  # (cos, sin)
    assert probe.prologue["model.embed_tokens"][1]
    assert probe.block_first_param == "hidden_states"
    assert type(last.chunk.model.embed_tokens).__name__ == "_ZeroStub"
    assert type(last.chunk.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    assert spec.support_reason("pp") is None and spec.support_reason("sp") is None


@pytest.mark.parametrize(("name", "carried", "block_list"), [
    ("hf_whisper", ("model.encoder",), "model.decoder.layers"),  # every decoder block attends to it
    ("hf_clip", ("vision_model", "visual_projection"), "text_model.encoder.layers"),  # into the loss after the text tower
])
def test_an_output_read_past_the_first_stage_is_carried_not_recomputed(name, carried, block_list) -> None:
    pytest.importorskip("transformers")
    _, spec, probe, (first, last) = _chunks(ZOO / f"{name}.py", [(0, 1), (1, 2)])
    assert spec.blocks_path == block_list and probe.carried == carried and probe.shared == ()
    held = last.chunk.get_submodule(carried[0])
    assert type(held).__name__ == "_Carried" and not list(held.parameters())  # no second copy to run or train
    assert first.chunk.get_submodule(carried[0]) is not None and list(first.chunk.get_submodule(carried[0]).parameters())


def test_stage_io_rebuilds_outputs_and_dict_inputs() -> None:
    io = pipe.StepIO({"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)})
    batch = {"input_ids": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4) + 1}
    kw = io.step_kwargs(batch)
    assert len(kw) == 2
    assert io.micro_batch(dict(kw))["labels"].equal(batch["labels"])
    flat = io.flatten_output({"logits": torch.ones(2), "aux": None})
    assert isinstance(flat, tuple) and len(flat) == 1
    assert io.rebuild_output(flat) == {"logits": flat[0], "aux": None}

    seen = []
    io.batch = batch
    loss = io.loss(lambda out, inputs: seen.append(inputs) or torch.zeros(()), row_target=True)
    loss(flat, torch.tensor([1]))
    assert seen[0]["input_ids"].equal(batch["input_ids"][1:2])


def test_sp_hooks_find_a_keyword_input() -> None:
    from autopar.executor.parallel.tensor_parallel import _map_first_input, _map_first_output

    class Attn(nn.Module):
        def forward(self, hidden_states, mask=None):
            return hidden_states

    m = Attn()
    args, kwargs = _map_first_input(m, (), {"hidden_states": torch.ones(1), "mask": None}, lambda x: x * 2)
    assert args == () and kwargs["hidden_states"].item() == 2 and kwargs["mask"] is None
    args, _ = _map_first_input(m, (torch.ones(1),), {}, lambda x: x * 3)
    assert args[0].item() == 3
    with pytest.raises(RuntimeError, match="hidden_states"):
        _map_first_input(m, (), {"mask": None}, lambda x: x)
    out = _map_first_output((torch.ones(1), None), lambda x: x + 1)
    assert out[0].item() == 2 and out[1] is None


def test_hf_attention_support_and_selective_recompute_route() -> None:
    pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from autopar.executor.parallel import hf_attention

    llama = model_spec(load_model_file(ZOO / "hf_llama.py"))
    assert llama.hf_attention is not None and llama.hf_attention.module == "self_attn"
    assert llama.support_reason("cp") is None and llama.support_reason("selective") is None
    mistral = model_spec(load_model_file(ZOO / "hf_mistral.py"))
    assert "window or chunk of 16 tokens" in mistral.support_reason("cp")
    assert mistral.support_reason("selective") is None

    calls = []

    def counting(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("test_counting", counting)
    mf = load_model_file(ZOO / "hf_llama.py")
    torch.manual_seed(0)
    model = mf.build("cpu")
    model.config._attn_implementation = "test_counting"
    tokens = mf.example_inputs(2, "cpu")
    plain = mf.loss_fn(model(tokens), tokens)
    plain.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls.clear()
    assert hf_attention.install(model, "model.layers", "self_attn", recompute=True) == 4
    assert model.config._attn_implementation == "autopar_test_counting"
    loss = mf.loss_fn(model(tokens), tokens)
    assert len(calls) == 4  # forward: once per layer, through the original implementation
    loss.backward()
    assert len(calls) == 8  # backward recomputed each layer's attention
    assert torch.equal(loss, plain)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7)


_HEAD_READS_EMBEDDING = '''
import torch
from torch import nn

SEQ_LEN = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(4))

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return h @ self.embed.weight.T  # the head reads the prologue's table, no module of its own


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randint(0, 32, (micro_batch_size, SEQ_LEN))
'''


def test_a_prologue_module_whose_weight_the_head_reads_is_real_on_the_last_stage(tmp_path: Path) -> None:
    # Perceiver's byte head multiplies by the input embedding's weight: stubbed on the last stage, the
    # head read a meta stand-in and the loss was NaN at step 1
    path = tmp_path / "head_reads_embedding.py"
    path.write_text(_HEAD_READS_EMBEDDING, encoding="utf-8")
    _, _, probe, (_, last) = _chunks(path, [(0, 2), (2, 4)])
    assert probe.shared == ("embed",) and probe.carried == ()
    assert isinstance(last.chunk.embed, nn.Embedding) and last.chunk.embed.weight.shape == (32, 16)


_ONE_DROPOUT = '''
import torch
from torch import nn

SEQ_LEN = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.dropout = nn.Dropout(0.0)  # one module before and after the blocks
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        h = self.dropout(self.embed(ids))
        for b in self.blocks:
            h = b(h)
        return self.head(self.dropout(h))


def build_model():
    return Net()


def example_inputs(micro_batch_size):
    return torch.randint(0, 32, (micro_batch_size, SEQ_LEN))
'''


def test_a_parameter_free_module_the_prologue_runs_too_is_not_dropped_before_the_last_stage(tmp_path: Path) -> None:
    # HF XLNet applies one dropout to the embeddings and to the last block's output: as an epilogue
    # module it was replaced on the first stage, whose prologue then called the replacement
    path = tmp_path / "one_dropout.py"
    path.write_text(_ONE_DROPOUT, encoding="utf-8")
    _, _, probe, (first, _) = _chunks(path, [(0, 2), (2, 4)])
    assert "dropout" in probe.prologue and probe.epilogue == ("head",)
    assert isinstance(first.chunk.dropout, nn.Dropout)
