"""Every YAML autopar reads (plans, cluster profiles, measured profiles) goes through one hardened
reader (autopar.yamlload): an alias bomb, deep nesting and non-finite numbers are refused in one
line that names where, never the value; the planner's divisors do not count to n."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from autopar.cluster import SHIPPED_PROFILES, load_cluster
from autopar.errors import AutoparError, ClusterError, PlanError
from autopar.plan import parse_plan
from autopar.search.space import divisors
from autopar.yamlload import MAX_DEPTH, load_yaml

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def test_an_alias_bomb_is_refused_at_once() -> None:
    start = time.perf_counter()
    with pytest.raises(AutoparError, match="aliases expand it past") as info:
        load_yaml(LAUGHS, "bomb.yaml")
    assert time.perf_counter() - start < 1.0
    assert "lol" not in str(info.value) and len(str(info.value)) < 200


def test_aliases_that_stay_small_are_read() -> None:
    assert load_yaml("base: &b {tp: 2}\nx: *b\ny: *b\n", "ok.yaml") == {"base": {"tp": 2}, "x": {"tp": 2}, "y": {"tp": 2}}


def test_deep_nesting_is_one_line() -> None:
    for text in ("[" * 50_000 + "]" * 50_000, "a:\n" + "".join(f"{' ' * (i + 1)}k{i}:\n" for i in range(200))):
        with pytest.raises(AutoparError, match=f"nests deeper than {MAX_DEPTH} levels"):
            load_yaml(text, "deep.yaml")


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", ".NaN"])
def test_non_finite_numbers_are_refused_by_their_place(value: str) -> None:
    with pytest.raises(AutoparError, match=r"deep.yaml: parallel.stages\[1\]\[0\] is not a finite number") as info:
        load_yaml(f"parallel:\n  stages: [[0, 3], [{value}, 6]]\n", "deep.yaml")
    assert value.lower().lstrip("-.") not in str(info.value).lower().split("number")[0]


def test_a_plan_with_a_bomb_or_a_nan_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="aliases expand"):
        parse_plan(LAUGHS, "plan.yaml")
    with pytest.raises(PlanError, match="training.seq_len is not a finite number"):
        parse_plan("version: 1\ntraining: {seq_len: .nan}\n", "plan.yaml")


def _profile(tmp_path: Path, section: str, key: str, value: float) -> Path:
    data = yaml.safe_load((SHIPPED_PROFILES / "a100-80g.yaml").read_text())
    data.setdefault(section, {})[key] = value
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))  # PyYAML writes .nan / .inf
    return path


@pytest.mark.parametrize("section,key,value", [
    ("gpu", "peak_flops", float("nan")),
    ("host", "memory_bytes_per_node", float("inf")),
    ("network", "gpus_per_node", float("-inf")),
])
def test_a_profile_with_a_non_finite_number_is_one_line(tmp_path: Path, section: str, key: str, value: float) -> None:
    with pytest.raises(ClusterError, match=f"{section}.{key} is not a finite number"):
        load_cluster(str(_profile(tmp_path, section, key, value)))


def test_a_profile_bomb_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(LAUGHS)
    with pytest.raises(ClusterError, match="aliases expand"):
        load_cluster(str(path))


def test_divisors_do_not_count_to_n() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1] and divisors(97) == [1, 97]
    start = time.perf_counter()
    assert divisors(10**12)[-3:] == [250_000_000_000, 500_000_000_000, 10**12]
    assert time.perf_counter() - start < 1.0
