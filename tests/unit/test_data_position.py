"""A step's synthetic batch is a function of (seed, step) alone, so a run resumed under another plan
continues on the same data: a model file that draws its example with the global random state
(``torch.randint``) no longer sets the token range from whatever state training had left (dropout
and the plan's micro-batching change it), and the draw leaves the run's own random state alone."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar.executor.runtime.train import global_batch, rows
from autopar.modelfile import load_model_file

MODEL = '''
import torch
from autopar.models.gpt import GPT, GPTConfig, next_token_loss

CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16, vocab_size=1000, dropout=0.1)
SEQ_LEN = CONFIG.seq_len


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size: int):
    # drawn from the global random state, as many model files do
    return torch.randint(0, torch.randint(50, CONFIG.vocab_size, ()).item(), (micro_batch_size, CONFIG.seq_len))


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
'''


def test_a_steps_batch_does_not_depend_on_the_random_state_before_it(tmp_path: Path) -> None:
    path = tmp_path / "random_example.py"
    path.write_text(MODEL)
    mf = load_model_file(path)
    torch.manual_seed(1)
    first = global_batch(mf, 8, step=21, seed=0)
    torch.manual_seed(2)
    torch.rand(1000)  # training of another plan: other dropout draws, other micro-batches
    again = global_batch(mf, 8, step=21, seed=0)
    assert torch.equal(first, again)
    assert not torch.equal(first, global_batch(mf, 8, step=22, seed=0))
    # every plan slices the same rows out of it: two dp ranks' halves are the one rank's batch
    assert torch.equal(torch.cat([rows(first, 0, 4), rows(first, 4, 8)]), first)


def test_the_draw_leaves_the_runs_random_state_alone(tmp_path: Path) -> None:
    path = tmp_path / "random_example.py"
    path.write_text(MODEL)
    mf = load_model_file(path)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    global_batch(mf, 8, step=0, seed=0)
    assert torch.equal(torch.get_rng_state(), before)
