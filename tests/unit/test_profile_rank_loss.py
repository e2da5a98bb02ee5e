"""``autopar profile`` at tp > 1 on a model whose loss_fn reshapes the logits by the whole
vocabulary: the loss of one tp rank's vocabulary slice cannot run, so it is timed on the whole
logits, as the executor gathers them (profiler/layers.py ``_RankLoss``) -- where it crashed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.modelfile import load_model_file
from autopar.profiler.layers import LayerProfileConfig, _RankLoss, profile_layers

TINY_GPT = Path(__file__).resolve().parents[1] / "dist" / "models" / "tiny_gpt.py"


def test_a_loss_that_takes_the_slice_runs_on_it_and_one_that_cannot_runs_on_the_whole() -> None:
    out = torch.randn(2, 3, 4, requires_grad=True)  # one rank's slice of a vocabulary of 8 at tp 2
    sliced = _RankLoss(lambda o, _: o.float().pow(2).mean(), 2)
    assert sliced(out, None).item() == pytest.approx(out.pow(2).mean().item()) and sliced.note is None
    whole = _RankLoss(lambda o, _: o.reshape(6, 8).logsumexp(-1).mean(), 2)  # 2 x 3 tokens, 8 words
    whole(out, None).backward()
    assert "does not run on one rank's vocabulary slice" in whole.note and out.grad is not None
    with pytest.raises(RuntimeError):  # at tp 1 the loss's own error stands
        _RankLoss(lambda o, _: o.reshape(6, 8).sum(), 1)(out, None)


def test_a_vocabulary_reshaping_loss_on_an_output_object_runs_on_the_whole_logits() -> None:
    # A Hugging Face output (GPT-2's loss_fn reshapes output.logits by the vocabulary): the logits
    # inside it are widened, the rest of the output is left as it is.
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    logits = torch.randn(2, 3, 4, requires_grad=True)  # one rank's slice of a vocabulary of 8 at tp 2
    out = modeling_outputs.CausalLMOutputWithCrossAttentions(logits=logits)
    whole = _RankLoss(lambda o, _: o.logits.reshape(6, 8).logsumexp(-1).mean(), 2, rows=4)
    whole(out, None).backward()
    assert "does not run on one rank's vocabulary slice" in whole.note and logits.grad is not None
    keyed = _RankLoss(lambda o, _: o["logits"].reshape(6, 8).sum() + o["aux"].sum(), 2, rows=4)
    keyed({"logits": logits, "aux": torch.ones(2, 3)}, None)
    with pytest.raises(RuntimeError):  # no tensor of the rank's vocabulary rows: the loss's own error stands
        _RankLoss(lambda o, _: o["logits"].reshape(6, 8).sum(), 2, rows=5)({"logits": logits}, None)


def test_profile_at_tp_2_times_a_vocabulary_reshaping_loss(tmp_path: Path) -> None:
    source = TINY_GPT.read_text()
    vocab = int(source.split("vocab_size=")[1].split(",")[0].split(")")[0])
    model = tmp_path / "vocab_loss.py"
    model.write_text(source + f'''

def loss_fn(output, inputs):
    import torch.nn.functional as F
    return F.cross_entropy(output[:, :-1].reshape(-1, {vocab}).float(), inputs[:, 1:].reshape(-1))
''')
    mf = load_model_file(model)
    torch.set_num_threads(1)
    lines: list[str] = []
    cfg = LayerProfileConfig(micro_batches=(1,), tps=(1, 2), cps=(1,), dtype="fp32", warmup=0, repeats=1)
    table = profile_layers(mf, torch.device("cpu"), cfg, log=lines.append)
    assert {p.tp for p in table.regions["loss"]} == {1, 2}
    assert any("timed on the whole logits" in line for line in lines)
