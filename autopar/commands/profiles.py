"""``autopar profiles``: the cluster profiles autopar finds, with their key figures."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No arguments: every shipped and local profile is listed."""


def main(args: argparse.Namespace) -> int:
    from autopar.cluster import list_profiles, load_cluster
    from autopar.report import table

    rows = []
    for name, path in sorted(list_profiles().items()):
        c = load_cluster(str(path))
        rows.append((name, c.gpu_name, f"{c.peak_flops / 1e12:,.0f}", f"{c.memory_bytes / 2**30:,.0f}",
                     f"{c.memory_bandwidth_bytes_per_s / 1e12:.2f}", c.gpus_per_node,
                     f"{c.intra_node.bandwidth_bytes_per_s / 1e9:,.0f}", f"{c.inter_node.bandwidth_bytes_per_s / 1e9:,.0f}",
                     str(path)))
    print(table(["profile", "gpu", "TFLOP/s", "GiB", "HBM TB/s", "gpus/node", "NVLink GB/s", "NIC GB/s/gpu", "file"],
                rows, align="llrrrrrrl"))
    return 0
