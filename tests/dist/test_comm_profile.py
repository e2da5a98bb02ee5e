"""A 2-rank gloo collective profile: every collective measured over message sizes and fitted."""

from __future__ import annotations

import torch
from shared import Job, result, share


def _profile(_work_dir) -> dict | None:
    import torch.distributed as dist

    from autopar.profiler.comm import profile_comm

    prof = profile_comm(torch.device("cpu"), sizes=(2**12, 2**16, 2**20), repeats=3)
    from autopar.profiler.fsdp import profile_fsdp

    fsdp = profile_fsdp(torch.device("cpu"), prof["fits"], prof["rendezvous_s"], steps=3)
    if dist.get_rank() != 0:
        return None
    return ({k: (f.latency_s, f.bandwidth_bytes_per_s, f.points) for k, f in prof["fits"].items()}
            | {"_meta": (prof["ranks"], prof["link"], prof["memory_baseline_bytes"], prof["rendezvous_s"]),
               "_fsdp": fsdp})


PROFILE = share(2, [Job(name="comm-profile", fn=_profile)])[0]  # in the session's 2-rank spawn (shared.py)


def test_two_rank_gloo_comm_profile_fits_every_collective() -> None:
    from autopar.profile_tables import COLLECTIVES

    ranks = result(2, PROFILE)
    assert isinstance(ranks, list), f"the profile failed:\n{ranks}"
    got = ranks[0]
    ranks, link, baseline, rendezvous = got.pop("_meta")
    fsdp = got.pop("_fsdp")
    # FSDP2's per-tensor time on the reference model (4 units of 4 layers + a root layer)
    assert (fsdp["tensors"], fsdp["units"]) == (34, 5)
    assert all(fsdp[k] >= 0 for k in ("gather_s_per_tensor", "reduce_s_per_tensor", "optimizer_s_per_tensor"))
    # DTensor dispatch costs on CPU, not seconds per tensor; a difference of two timings, clamped at zero
    # when the shared machine's noise exceeds it
    assert fsdp["optimizer_s_per_tensor"] < 0.05
    assert ranks == 2 and link == "intra_node"
    assert 0 <= rendezvous < 0.05  # a wait for a descheduled partner, at most a few time slices
    assert 50 * 2**20 < baseline < 4 * 2**30  # a python + torch process, not zero, not absurd
    assert set(got) == set(COLLECTIVES)
    for kind, (latency, bandwidth, points) in got.items():
        assert [p[1] for p in points] == [2**12, 2**16, 2**20], kind
        assert all(p[0] == 2 and p[2] > 0 for p in points), kind
        assert latency >= 0 and 1e6 < bandwidth < 1e12, kind
        # the fit describes the measurements: the 1 MiB message within a factor 3
        from autopar.profiler.comm import hops_and_volume

        hops, vol = hops_and_volume(kind, 2, 2**20)
        assert points[-1][2] / 3 < hops * latency + vol / bandwidth < points[-1][2] * 3, kind
