"""Context parallelism for Hugging Face causal LMs fed the HF-Trainer way: a dict of ``input_ids``
and ``labels`` (spec.token_dict_keys, spec/support.cp_support), and HF's label loss computed over cp
shards (executor/parallel/context_parallel.py): target i = labels[i + 1], -100 ignored, mean over the whole
sequence's non-ignored targets -- SFT labels (-100 on a prompt prefix) included."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar.errors import AutoparError
from autopar.executor.parallel.context_parallel import (
    IGNORE,
    cp_next_token_loss,
    dict_batch,
    is_label_loss,
    num_targets_of,
    shard_batch,
    shard_indices,
)
from autopar.spec import ModelSpec, TPPlan, token_dict_keys
from autopar.spec.attention import HFAttention
from autopar.spec.support import cp_pp_support, cp_support

B, S = 2, 8


def _ids(*shape, dtype=torch.long, device="meta"):
    return torch.zeros(shape, dtype=dtype, device=device)


def test_token_dict_keys_accepts_the_hf_causal_lm_dict_and_nothing_else():
    ids = _ids(B, S)
    assert token_dict_keys({"input_ids": ids, "labels": _ids(B, S)}) == ("input_ids", "labels")
    assert token_dict_keys({"input_ids": ids}) == ("input_ids", None)
    assert token_dict_keys({"input_ids": ids, "labels": _ids(B, S), "attention_mask": _ids(B, S)}) == (
        "input_ids", "labels")
    refused = [
        ids,  # a plain tensor: spec.inputs_are_token_batch's case, not a dict
        {"input_ids": ids, "labels": _ids(B, S), "pixel_values": _ids(B, 3, dtype=torch.float32)},
        {"input_ids": ids, "labels": _ids(B, S - 1)},  # labels of another shape
        {"input_ids": ids, "attention_mask": _ids(B, S + 1)},
        {"input_ids": _ids(B, S, dtype=torch.float32)},  # not token ids
        {"input_ids": _ids(B, S, 4)},  # not (batch, seq)
        {"input_ids": ids, "labels": _ids(B, S, dtype=torch.float32)},
        {"labels": _ids(B, S)},
        (ids, ids),
    ]
    for inputs in refused:
        assert token_dict_keys(inputs) == (None, None), inputs


def _spec(**kw) -> ModelSpec:
    hf = HFAttention(module="self_attn", implementation="eager", causal=True, sliding_window=None, dropout=0.0,
                     position_ids=True)
    base = dict(blocks_path="model.layers", num_blocks=2, blocks_kind="ModuleList",
                tp=TPPlan(styles={}, source="none"), core_name=None, num_heads=4, num_kv_heads=2,
                accepts_positions=False, is_sequence_model=True, hf_attention=hf)
    return ModelSpec(**{**base, **kw})


def test_cp_support_accepts_a_token_dict_and_refuses_other_inputs_in_one_line():
    assert cp_support(_spec(token_key="input_ids", labels_key="labels")) is None
    assert cp_support(_spec(token_key="input_ids")) is None
    assert cp_support(_spec(inputs_are_token_batch=True)) is None
    why = cp_support(_spec())
    assert why is not None and "\n" not in why and "input_ids" in why and "token tensor" in why
    # the attention rules still apply to dict models
    sliding = dataclasses.replace(_spec(token_key="input_ids").hf_attention, sliding_window=16)
    assert "window or chunk of 16 tokens" in cp_support(_spec(token_key="input_ids", hf_attention=sliding))


def _sft_batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    labels = ids.clone()
    labels[0, :9] = IGNORE  # a long prompt: its few targets sit in one cp chunk
    labels[1, :2] = IGNORE
    labels[2, 5] = IGNORE  # an ignored label inside the answer
    return ids, labels


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_sharded_label_loss_is_hf_mean_over_the_whole_sequences_targets(cp):
    vocab = 11
    ids, labels = _sft_batch(vocab)
    logits = torch.randn(*ids.shape, vocab, generator=torch.Generator().manual_seed(4))
    # HF's causal-LM loss: shift, ignore -100, mean over the non-ignored targets
    want = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    n = num_targets_of(labels)
    assert n == int((labels[:, 1:] != IGNORE).sum())
    # the dp x cp gradient average divides by cp: the mean of the ranks' losses is the sequence's loss
    ranks = []
    for r in range(cp):
        local, positions, targets = shard_batch(ids, cp, r, labels=labels)
        assert torch.equal(positions, shard_indices(ids.shape[1], cp, r))
        assert torch.equal(local, ids[:, positions])
        ranks.append(cp_next_token_loss(logits[:, positions], targets, n, cp))
    torch.testing.assert_close(torch.stack(ranks).mean(), want)
    if cp > 1:  # a shard alone (HF's loss over the local labels) would not be the loss
        local_labels = labels[:, shard_indices(ids.shape[1], cp, 0)]
        alone = F.cross_entropy(logits[:, shard_indices(ids.shape[1], cp, 0)][:, :-1].reshape(-1, vocab),
                                local_labels[:, 1:].reshape(-1), ignore_index=IGNORE)
        assert not torch.isclose(alone, want)


def test_hf_own_loss_function_agrees():
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    vocab = 11
    ids, labels = _sft_batch(vocab)
    logits = torch.randn(*ids.shape, vocab, generator=torch.Generator().manual_seed(5))
    want = loss_utils.ForCausalLMLoss(logits, labels, vocab)
    _, _, targets = shard_batch(ids, 1, 0, labels=labels)
    torch.testing.assert_close(cp_next_token_loss(logits, targets, num_targets_of(labels), 1), want)


def test_dict_batch_takes_labels_or_tokens_and_refuses_padding():
    ids, labels = _sft_batch(11)
    tokens, got = dict_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)},
                             "input_ids", "labels")
    assert tokens is ids and got is labels
    assert dict_batch({"input_ids": ids}, "input_ids", None)[1] is ids
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with pytest.raises(AutoparError, match="attention_mask to be all ones"):
        dict_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, "input_ids", "labels")
    all_ignored = torch.full_like(ids, IGNORE)
    assert num_targets_of(all_ignored) == 1  # the loss is 0 there, not NaN


def test_is_label_loss_runs_the_model_file_loss_on_a_prefix():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                   use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    labels = ids.clone()
    labels[:, :6] = IGNORE  # the whole 2·cp = 4-token prefix is a prompt: its tokens stand in as labels
    mb = {"input_ids": ids, "labels": labels}

    def own(out, inputs):
        return out.loss

    def logits_ce(out, inputs):  # the same loss written out on output.logits and the labels
        lg = out.logits[:, :-1]
        return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), inputs["labels"][:, 1:].reshape(-1))

    assert is_label_loss(model, own, mb, "input_ids", "labels", cp=2)
    assert is_label_loss(model, logits_ce, mb, "input_ids", "labels", cp=2)
    assert is_label_loss(model, own, {"input_ids": ids, "labels": ids.clone()}, "input_ids", "labels", cp=2)
    assert not is_label_loss(model, lambda out, inputs: 2 * out.loss, mb, "input_ids", "labels", cp=2)
    assert not is_label_loss(model, lambda out, inputs: out.logits.float().pow(2).mean(), mb, "input_ids", "labels", cp=2)
    assert not is_label_loss(model, lambda out, inputs: out.loss[None].repeat(2), mb, "input_ids", "labels", cp=2)
    other_labels = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}

    def loss_on_ids(out, inputs):  # next-token loss on input_ids, whatever the labels say
        return model(input_ids=inputs["input_ids"], labels=inputs["input_ids"]).loss

    assert not is_label_loss(model, loss_on_ids, other_labels, "input_ids", "labels", cp=2)


def test_cp_with_pipeline_stages_is_refused_for_dict_batches_only():
    assert "dict" in cp_pp_support(_spec(token_key="input_ids", labels_key="labels"))
    assert cp_pp_support(_spec(inputs_are_token_batch=True)) is None


def test_preflight_refuses_cp_x_pp_on_a_dict_model_in_one_line():
    pytest.importorskip("transformers")
    from autopar.executor.runtime.checks import preflight
    from autopar.modelfile import load_model_file
    from autopar.plan import plan_from_dict

    zoo = Path(__file__).resolve().parents[2] / "examples" / "zoo" / "hf_qwen2.py"

    def plan(pp: int, cp: int):
        return plan_from_dict({
            "version": 1, "model": {"file": str(zoo), "num_blocks": 4},
            "cluster": {"profile": "a100-80g", "num_gpus": pp * cp, "gpus_per_node": 8},
            "training": {"global_batch_size": 2, "micro_batch_size": 1, "seq_len": 32, "dtype": "fp32",
                         "optimizer": "adamw"},
            "parallel": {"dp": 1, "tp": 1, "pp": pp, "cp": cp, "cp_kind": "ring"}})

    mf = load_model_file(zoo)
    spec, _ = preflight(plan(1, 2), mf, 2)  # cp alone runs on the dict model
    assert spec.token_key == "input_ids" and spec.labels_key == "labels"
    with pytest.raises(AutoparError, match=r"pipeline stages cannot run .*plan with pp = 1 or cp = 1") as err:
        preflight(plan(2, 2), mf, 4)
    assert "\n" not in str(err.value)
