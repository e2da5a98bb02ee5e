"""The optimizer's own precision is a setting of the software, priced as it keeps its state: torch's
Adam and Megatron's distributed optimizer keep fp32 moments and an fp32 master beside a 16-bit
parameter (12 bytes per parameter); Apex's DistributedFusedAdam, as NeMo configures it from
``optim.dtype``, keeps bf16 moments and no master (4) or fp32 moments and the master's low 16 bits
(10). Nemotron-4 340B's published run (dgxc, 128 H100s) is admitted once its config's optimizer is."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from autopar.cluster import SHIPPED_PROFILES, cluster_from_dict, load_cluster
from autopar.cost.estimate import estimate_plan
from autopar.cost.memory import optimizer_state_bytes_per_param, state_bytes_per_param
from autopar.errors import ClusterError
from autopar.reference_h100 import nemo_optimizer_precision, public_plan, public_runs, run_graph, software_cluster


def test_bytes_per_parameter_of_each_precision() -> None:
    assert optimizer_state_bytes_per_param("adam", 2) == 12  # fp32 master + two fp32 moments
    assert optimizer_state_bytes_per_param("adam", 4) == 8  # the fp32 parameter is its own master
    assert optimizer_state_bytes_per_param("adam", 2, moment_bytes=2, master_bytes=0) == 4
    assert optimizer_state_bytes_per_param("adam", 2, moment_bytes=4, master_bytes=2) == 10
    assert optimizer_state_bytes_per_param("sgd", 2, moment_bytes=2, master_bytes=0) == 2  # one momentum
    z1 = state_bytes_per_param(zero=1, shard_degree=2, dtype_bytes=2, optimizer="adam", moment_bytes=2, master_bytes=0)
    assert (z1.params, z1.grads, z1.optimizer) == (2, 2, 2)  # the 4 state bytes sharded over dp 2


def test_nemo_optimizer_names_map_to_what_apex_keeps() -> None:
    assert nemo_optimizer_precision("distributed_fused_adam", "bf16") == (2.0, 0.0)  # store_params False
    assert nemo_optimizer_precision("distributed_fused_adam", "fp32") == (4.0, 2.0)  # store_param_remainders
    assert nemo_optimizer_precision("mcore_distributed_optim", "bf16") == (4.0, None)  # Megatron-Core: fp32 state


def test_profile_settings_are_checked() -> None:
    base = yaml.safe_load((SHIPPED_PROFILES / "a100-80g.yaml").read_text())
    base["software"] = {**base.get("software", {}), "optimizer_moment_bytes": 2, "master_weight_bytes": 0}
    c = cluster_from_dict(base, "x")
    assert (c.optimizer_moment_bytes, c.master_weight_bytes) == (2, 0)
    assert load_cluster("h100-80g").master_weight_bytes is None  # autopar run: fp32 master
    for key, bad in (("optimizer_moment_bytes", 1), ("master_weight_bytes", 8), ("master_weight_bytes", True)):
        broken = {**base, "software": {**base["software"], key: bad}}
        with pytest.raises(ClusterError, match=f"'{key}' must be"):
            cluster_from_dict(broken, "x")


def test_nemotron4_340b_run_is_admitted_with_its_optimizer() -> None:
    run = next(r for r in public_runs("dgxc") if r.name == "nemotron4-340b-128")
    assert run.nemo_optimizer == ("distributed_fused_adam", "bf16")
    cluster, profile = software_cluster(run)
    plan, graph = public_plan(run, profile), run_graph(run)
    est = estimate_plan(plan, graph, cluster)
    fp32_state = estimate_plan(plan, graph, dataclasses.replace(cluster, optimizer_moment_bytes=4.0,
                                                                master_weight_bytes=None))
    assert est.fits and not fp32_state.fits
    rank0 = est.ranks[0]
    params = rank0.params
    # bf16 parameters, NeMo's bf16 gradient buffer, (2 + 2) bytes of moments over dp 2; the fp32
    # state would add an fp32 master and fp32 moments: (4 + 8) / 2 - 4 / 2 = 4 bytes per parameter more
    assert rank0.memory_bytes["optimizer"] == pytest.approx(2 * params)
    assert fp32_state.ranks[0].memory_bytes["optimizer"] - rank0.memory_bytes["optimizer"] == pytest.approx(4 * params)
