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


def test_a_tp_rank_copy_slices_vocabulary_buffers_and_keeps_ids_beside_labels_whole() -> None:
    from torch import nn

    from autopar.profiler.layers import _clamp_tokens, _rank_model

    class Seq2Seq(nn.Module):  # BART's shape: a vocabulary bias added to the logits after the head
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.head = nn.Linear(4, 8, bias=False)
            self.register_buffer("final_logits_bias", torch.zeros(1, 8))

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(input_ids)
            for layer in self.layers:
                h = layer(h)
            return self.head(h) + self.final_logits_bias

    with torch.device("meta"):
        rank, rows = _rank_model(Seq2Seq(), "layers", {}, 2)
    assert rows == 4 and rank.final_logits_bias.shape == (1, 4)
    ids = torch.tensor([[7, 1, 6]])
    looked_up = []
    rank.embed.register_forward_hook(lambda m, args, out: looked_up.append(args[0]))
    assert rank(ids.to("meta")).shape == (1, 3, 4)  # the rank's slice of the logits, its bias sliced too
    assert looked_up and rank.embed.num_embeddings == 4  # ids reach the rank's table through its wrap
    batch = _clamp_tokens({"input_ids": ids, "labels": ids}, rows)
    assert batch["input_ids"] is ids and batch["labels"].tolist() == [[3, 1, 2]]
    assert _clamp_tokens(ids, rows).tolist() == [[3, 1, 2]]
