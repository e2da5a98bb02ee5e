"""The memory margin (``gpu.memory_margin_fraction``, ``plan --memory-margin``): the share of device
memory every plan leaves free, read from the profile, checked in one place, and what the search,
the estimate and the CLI's words measure a plan against."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from autopar.cluster import SHIPPED_PROFILES, cluster_from_dict, load_cluster, usable_text
from autopar.errors import ClusterError


def test_the_shipped_gpus_leave_3_percent_and_the_cpu_profiles_none() -> None:
    for name in ("a100-80g", "a100-80g-megatron", "h100-80g", "h100-80g-megatron", "h200-141g"):
        c = load_cluster(name)
        assert c.memory_margin_fraction == 0.03
        assert c.usable_memory_bytes == pytest.approx(0.97 * c.memory_bytes)
    assert load_cluster("cpu-local-2").usable_memory_bytes == load_cluster("cpu-local-2").memory_bytes


@pytest.mark.parametrize("value", [-0.01, 0.5, 0.9])
def test_a_margin_outside_0_to_half_is_refused_in_one_line(value: float) -> None:
    data = yaml.safe_load((SHIPPED_PROFILES / "h100-80g.yaml").read_text())
    data["gpu"]["memory_margin_fraction"] = value
    with pytest.raises(ClusterError, match=r"'memory_margin_fraction' must be at least 0 and below 0\.5") as err:
        cluster_from_dict(data, "x")
    assert "\n" not in str(err.value)
    from autopar import api

    choice = api.choose_cluster("h100-80g")
    with pytest.raises(ClusterError, match=r"--memory-margin must be at least 0 and below 0\.5"):
        api.with_memory_margin(choice, value)


def test_plans_are_measured_against_what_is_left(small_gpt, make_plan) -> None:
    from autopar import api
    from autopar.cost.estimate import estimate_plan

    h100 = load_cluster("h100-80g")
    est = estimate_plan(make_plan(16, dp=8), small_gpt, h100)
    assert est.capacity_bytes == h100.usable_memory_bytes < h100.memory_bytes
    whole = api.with_memory_margin(api.choose_cluster("h100-80g"), 0.0).cluster
    assert estimate_plan(make_plan(16, dp=8), small_gpt, whole).capacity_bytes == h100.memory_bytes
    assert usable_text(h100) == "76.8 GiB (79.2 less a 3 % margin)"
    assert usable_text(dataclasses.replace(h100, memory_margin_fraction=0.0)) == "79.2 GiB"
