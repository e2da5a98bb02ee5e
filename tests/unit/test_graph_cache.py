"""The graph cache: a hit is the graph a trace gives, any change of its inputs misses, a damaged
entry is rebuilt (never trusted), and a warm ``autopar plan`` runs without torch."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.graph import cache
from autopar.graph.model_graph import ModelGraph

REPO = Path(__file__).resolve().parents[2]
TINY = '''"""A 2-block GPT for the cache tests."""
from autopar.models.gpt import GPT, GPT_TP_PLAN, GPTConfig, example_tokens, next_token_loss

CONFIG = GPTConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128)
SEQ_LEN = CONFIG.seq_len
tp_plan = GPT_TP_PLAN
pipeline_blocks = "layers"


def build_model():
    return GPT(CONFIG)


def example_inputs(micro_batch_size):
    return example_tokens(CONFIG.seq_len, CONFIG.vocab_size, micro_batch_size)


def loss_fn(output, inputs):
    return next_token_loss(output, inputs)
'''

# Imported by a subprocess (sitecustomize): any import of torch fails, as if it were not installed.
TORCH_BLOCKER = '''
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        # torch: a warm plan never traces; networkx: the layer graph is built only when read
        # (ModelGraph.graph), and planning reads the regions.
        if name.split(".")[0] in ("torch", "networkx"):
            raise ImportError(f"{name.split('.')[0]} is blocked in this test")
        return None

sys.meta_path.insert(0, _NoTorch())
'''


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
    kind: str
    widths: tuple[int, ...]
    ratio: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Holder:
    spec: Spec | None
    by_name: dict[str, Spec]
    pair: tuple[int, float]


@pytest.fixture()
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "autopar"


@pytest.fixture()
def tiny_model(tmp_path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(TINY, encoding="utf-8")
    return path


def _graph(path: Path, **kw):
    misses = []
    graph, source = cache.cached_graph(path, seq_len=kw.pop("seq_len", None), dtype=kw.pop("dtype", "bf16"),
                                       on_miss=lambda: misses.append(1), **kw)
    return graph, source, bool(misses)


def _same_graph(a: ModelGraph, b: ModelGraph) -> None:
    assert a == b  # every compared field
    assert dict(a.graph.nodes(data=True)) == dict(b.graph.nodes(data=True))
    assert list(a.graph.edges(data=True)) == list(b.graph.edges(data=True))
    assert a.graph.graph == b.graph.graph


def test_round_trip_is_exact(tiny_model, cache_home) -> None:
    cold, _, missed = _graph(tiny_model)
    assert missed
    decoded = cache.decode(ModelGraph, json.loads(json.dumps(cache.encode(cold))))
    _same_graph(cold, decoded)
    assert decoded.model_flops_per_sample() == cold.model_flops_per_sample()


def test_hit_after_miss_then_edit_invalidates(tiny_model, cache_home) -> None:
    first, src, missed = _graph(tiny_model)
    assert missed and list((cache_home / "graphs").glob("tiny-*.json"))
    again, src2, missed = _graph(tiny_model)
    assert not missed
    _same_graph(first, again)
    assert src2 == src and src2.declared_seq_len == 32
    tiny_model.write_text(TINY.replace("num_layers=2", "num_layers=3"), encoding="utf-8")
    edited, src3, missed = _graph(tiny_model)
    assert missed and edited.num_blocks == 3 and src3.sha256 != src.sha256
    # a comment changes the bytes, so it is a new entry too (the key is the file's content)
    tiny_model.write_text(TINY.replace("num_layers=2", "num_layers=3") + "# edited\n", encoding="utf-8")
    assert _graph(tiny_model)[2]


def test_tracing_inputs_and_versions_are_in_the_key(tiny_model, cache_home, monkeypatch) -> None:
    _graph(tiny_model)
    assert _graph(tiny_model, seq_len=16)[2], "another sequence length must miss"
    assert _graph(tiny_model, dtype="fp32")[2], "another dtype must miss"
    assert not _graph(tiny_model)[2]
    monkeypatch.setattr(cache, "_torch_version", lambda: "0.0.0-other")
    assert _graph(tiny_model)[2], "another torch must miss"
    monkeypatch.setattr(cache, "schema_fingerprint", lambda tp=None: "a ModelGraph with a new field")
    assert _graph(tiny_model)[2], "another ModelGraph schema must miss"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong-type", "other-key", "extra-field", "pickle"])
def test_damaged_entry_is_rebuilt_not_trusted(tiny_model, cache_home, damage) -> None:
    good, _, _ = _graph(tiny_model)
    (entry,) = (cache_home / "graphs").glob("tiny-*.json")
    text = entry.read_text(encoding="utf-8")
    data = json.loads(text)
    if damage == "garbage":
        entry.write_bytes(b"\x00\xff not json")
    elif damage == "truncated":
        entry.write_text(text[: len(text) // 2], encoding="utf-8")
    elif damage == "wrong-type":
        data["graph"]["num_blocks"] = "2"
        entry.write_text(json.dumps(data), encoding="utf-8")
    elif damage == "other-key":
        data["key"]["model_sha256"] = "0" * 64
        entry.write_text(json.dumps(data), encoding="utf-8")
    elif damage == "extra-field":
        data["graph"]["__reduce__"] = "os.system"
        entry.write_text(json.dumps(data), encoding="utf-8")
    else:
        import pickle

        entry.write_bytes(pickle.dumps(good))
    rebuilt, _, missed = _graph(tiny_model)
    assert missed, "a damaged entry must not be used"
    _same_graph(good, rebuilt)
    assert json.loads(entry.read_text(encoding="utf-8"))["key"] == data["key"] or damage == "other-key"
    assert not _graph(tiny_model)[2], "the rebuilt entry is written back"


def test_generic_decoding_of_new_field_types() -> None:
    """A field the ModelGraph may gain (a nested spec dataclass, tuples, optionals, mappings)
    round-trips with no cache code, and a value of the wrong type is refused."""
    value = Holder(spec=Spec(kind="gpt", widths=(1, 2), ratio=0.5), by_name={"a": Spec(kind="x", widths=())},
                   pair=(3, 4.0))
    assert cache.decode(Holder, json.loads(json.dumps(cache.encode(value)))) == value
    bad = cache.encode(value)
    bad["pair"] = [3, "4"]
    with pytest.raises(cache._Corrupt):
        cache.decode(Holder, bad)


def test_cache_dir_follows_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "autopar"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec says: ignore relative paths
    assert cache.cache_dir() == Path.home() / ".cache" / "autopar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == Path.home() / ".cache" / "autopar"


def _cli(args, env_extra, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("AUTOPAR_PROFILES", None)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env_extra.get("PYTHONPATH"), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "autopar", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_warm_plan_runs_without_torch_and_equals_the_cold_plan(tiny_model, tmp_path) -> None:
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(TORCH_BLOCKER, encoding="utf-8")
    no_torch = dict(xdg, PYTHONPATH=str(blocker))
    args = ["plan", tiny_model, "--gpus", "4", "--gpus-per-node", "4", "--quiet"]

    cold = _cli([*args, "-o", tmp_path / "cold.yaml"], xdg, tmp_path)
    assert cold.returncode == 0, cold.stderr
    # Without the cache the model must be traced, which needs torch: the blocker works.
    blocked = _cli([*args, "--no-cache", "-o", tmp_path / "x.yaml"], no_torch, tmp_path)
    assert blocked.returncode != 0 and "torch" in blocked.stderr
    warm = _cli([*args, "-o", tmp_path / "warm.yaml"], no_torch, tmp_path)
    assert warm.returncode == 0, warm.stderr
    assert (tmp_path / "warm.yaml").read_bytes() == (tmp_path / "cold.yaml").read_bytes()
    assert warm.stdout.split("searched")[0] == cold.stdout.split("searched")[0]  # the same table
    # estimate of that plan is warm too (its own key: the plan's sequence length)
    _cli(["estimate", tiny_model, tmp_path / "cold.yaml", "--no-rank"], xdg, tmp_path)
    est = _cli(["estimate", tiny_model, tmp_path / "cold.yaml", "--no-rank"], no_torch, tmp_path)
    assert est.returncode == 0, est.stderr


SIZED_BY_ENV = TINY.replace('CONFIG = GPTConfig(num_layers=2, hidden_size=64,',
                            'import os\nCONFIG = GPTConfig(num_layers=2, hidden_size=int(os.environ.get("TINY_WIDTH", "64")),')
SIZED_BY_MODULE = TINY.replace('CONFIG = GPTConfig(num_layers=2, hidden_size=64,',
                               'from tiny_sizes import WIDTH\nCONFIG = GPTConfig(num_layers=2, hidden_size=WIDTH,')
SIZED_BY_FILE = TINY.replace('CONFIG = GPTConfig(num_layers=2, hidden_size=64,',
                             'import json, pathlib\nWIDTH = json.loads((pathlib.Path(__file__).parent / "sizes.json")'
                             '.read_text())["width"]\nCONFIG = GPTConfig(num_layers=2, hidden_size=WIDTH,')


def test_a_file_sized_by_an_environment_variable_is_not_served_the_cached_size(cache_home, tmp_path, monkeypatch):
    path = tmp_path / "env_sized.py"
    path.write_text(SIZED_BY_ENV, encoding="utf-8")
    monkeypatch.setenv("TINY_WIDTH", "64")
    small, _, missed = _graph(path)
    assert missed
    assert _graph(path)[2] is False  # the same environment: a hit
    monkeypatch.setenv("TINY_WIDTH", "128")
    big, _, missed = _graph(path)
    assert missed and big.num_params > small.num_params
    monkeypatch.setenv("TINY_WIDTH", "64")
    again, _, missed = _graph(path)  # one entry per key: the last build's, traced again for this environment
    assert missed and again.num_params == small.num_params


@pytest.mark.parametrize("source,edit", [
    (SIZED_BY_MODULE, ("tiny_sizes.py", "WIDTH = 64\n", "WIDTH = 128\n")),
    (SIZED_BY_FILE, ("sizes.json", '{"width": 64}', '{"width": 128}')),
], ids=["imported-module", "config-file"])
def test_a_file_sized_by_a_file_beside_it_misses_when_that_file_changes(cache_home, tmp_path, monkeypatch, source,
                                                                       edit):
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))  # the module beside the model file is importable
    name, before, after = edit
    path = tmp_path / "sized.py"
    path.write_text(source, encoding="utf-8")
    (tmp_path / name).write_text(before, encoding="utf-8")
    sys.modules.pop("tiny_sizes", None)
    small, _, missed = _graph(path)
    assert missed and _graph(path)[2] is False
    (tmp_path / name).write_text(after, encoding="utf-8")
    sys.modules.pop("tiny_sizes", None)
    importlib.invalidate_caches()
    big, _, missed = _graph(path)
    assert missed and big.num_params > small.num_params
