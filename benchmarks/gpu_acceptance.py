"""The one-GPU acceptance run: what a careful read of the executor says may break or mis-measure on
CUDA + NCCL (../shared/reviews/gpu-readiness.md, "One-GPU acceptance script"), checked on the GPU.

Fourteen checks, each under about a minute on one H100/H200, each printing what it measured and
PASS / FAIL / INFO (a figure to record, no verdict) / SKIP (needs what this machine lacks). The
finding each covers is in brackets. Run it first whenever a GPU is at hand, and commit its output to
docs/results.md:

    python benchmarks/gpu_acceptance.py                 # cuda when present
    python benchmarks/gpu_acceptance.py --device cpu    # dry run: every code path on CPU ranks
    python benchmarks/gpu_acceptance.py --only 1,2,4 --json out.json
    python benchmarks/gpu_acceptance.py --device cpu --quick   # dry run on a tiny model
    python benchmarks/gpu_acceptance.py --device cpu --quick --jobs 2   # the same, two checks at a time

Exit 0 when no check FAILs. The dry run is part of the tests (tests/cli/test_gpu_acceptance.py, with
--quick --jobs 2), so the script itself is known to work before the GPU's minutes are spent on it. --quick
(dry run only) swaps gpt_small for the same GPT at its tiny size (examples/zoo/autopar_gpt.py: 4
layers, hidden 64, 32 tokens), gives check 8 one tensor instead of six and profiles on one core
(check 6's contention curve, which a GPU profile does not take, then starts one helper rank, not
three on two cores): every check runs every
step it runs on the GPU (profile, plan, validate, run, compare, the probes), in a fraction of the
time; what it measures then says nothing about gpt_small.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SMALL = REPO / "examples" / "gpt_small.py"
TINY = REPO / "examples" / "zoo" / "autopar_gpt.py"  # gpt_small's GPT at 4 layers, hidden 64, 32 tokens
# the model every check plans, profiles and runs; --quick (a dry run's) takes TINY's
MODEL: dict[str, Any] = {"file": SMALL, "num_blocks": 8, "seq_len": 128, "quick": False}
GIB = 2**30


def use_quick_model() -> None:
    MODEL.update(file=TINY, num_blocks=4, seq_len=32, quick=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _autopar(args: list[str], device: str, timeout_s: float = 240, env: dict | None = None,
             one_core: bool = False) -> subprocess.CompletedProcess:
    """``python -m autopar ARGS``; ``one_core``: on the first core this process may use (Linux)."""
    full = dict(os.environ, AUTOPAR_DEVICE=device, **(env or {}))
    pin = None
    if one_core and hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
    return subprocess.run([sys.executable, "-m", "autopar", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout_s, preexec_fn=pin)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("autopar: error:")]


def _probe(name: str, device: str, work: Path, timeout_s: float = 240) -> dict:
    """Run ``--probe name`` in a fresh process (its own CUDA context and process group)."""
    quick = ["--quick"] if MODEL["quick"] else []
    proc = subprocess.run([sys.executable, __file__, "--probe", name, "--device", device, "--work", str(work), *quick],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"probe {name} exit {proc.returncode}: {tail[:300]}")


# -- plans ----------------------------------------------------------------------------------------

def profile_for(device: str) -> str:
    """The shipped profile of this machine's device (the dry run plans for the CPU profile)."""
    if device == "cpu":
        return "cpu-local-2"
    import torch

    return "h200-141g" if "H200" in torch.cuda.get_device_name(0) else "h100-80g"


def plan_dict(device: str, dtype: str | None = None, **parallel: Any) -> dict:
    """A one-rank plan of examples/gpt_small.py (8 blocks, seq 128; ``MODEL``), ``parallel`` keys as in YAML;
    ``dtype`` by default bf16 on the GPU, fp32 on the dry run (the CPU profile was measured in fp32)."""
    par = {"dp": 1, "tp": 1, "pp": 1, **parallel}
    n = par["dp"] * par["tp"] * par["pp"] * par.get("cp", 1)
    return {"version": 1, "model": {"file": str(MODEL["file"]), "num_blocks": MODEL["num_blocks"]},
            "cluster": {"profile": profile_for(device), "num_gpus": n, "gpus_per_node": 8},
            "training": {"global_batch_size": 8, "micro_batch_size": 4, "seq_len": MODEL["seq_len"],
                         "dtype": dtype or ("bf16" if device == "cuda" else "fp32"),
                         "optimizer": "adamw"},
            "parallel": par}


def write_plan(work: Path, name: str, device: str, dtype: str | None = None, **parallel: Any) -> Path:
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan_dict(device, dtype, **parallel), sort_keys=False))
    return path


# -- probes (run in a child process) ---------------------------------------------------------------

def _init_world1(device: str) -> Any:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    return dev


def probe_recorder(device: str, work: Path) -> dict:
    """[B7, C1, M5, M4] NCCL at world 1: recorder entries after 8 all-reduces, and the device memory
    the CUDA context, the first cuBLAS GEMM and NCCL take (the reserve the profile prices)."""
    import torch
    import torch.distributed as dist

    from autopar.executor.runtime.faults import enable_flight_recorder, last_collective

    out: dict[str, Any] = {}
    used = []
    if device == "cuda":
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        used.append(("context", total - free))
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        (a @ a).sum().item()
        del a
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used.append(("first GEMM", total - free))
    enable_flight_recorder()
    dev = _init_world1(device)
    x = torch.ones(1024, device=dev)
    for _ in range(8):
        dist.all_reduce(x)
    if device == "cuda":
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used.append(("NCCL + 8 all-reduces", total - free))
    import torch._C._distributed_c10d as c10d_c

    for fn in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d_c, fn, None)
        try:
            out[fn] = len(json.loads(dump(True, False)).get("entries") or []) if dump else None
        except Exception as exc:  # noqa: BLE001 - recorded as what it is
            out[fn] = f"error: {type(exc).__name__}"
    rec = last_collective()
    out["last_collective"] = rec.describe() if rec else None
    if device == "cuda":
        try:
            dist.all_reduce(torch.ones(1))  # a CPU tensor over NCCL: refused (the reason for B4's device copy)
            out["cpu_tensor_over_nccl"] = "accepted"
        except Exception as exc:  # noqa: BLE001
            out["cpu_tensor_over_nccl"] = f"refused ({type(exc).__name__})"
        out["total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    out["used_bytes"] = used
    dist.destroy_process_group()
    return out


def _build(device: str, work: Path, **parallel: Any) -> tuple[Any, Any, Any]:
    from autopar.executor.runtime.start import StartOptions, start
    from autopar.modelfile import load_model_file
    from autopar.plan import plan_from_dict

    dev = _init_world1(device)
    plan = plan_from_dict(plan_dict(device, **parallel))
    mf = load_model_file(plan.model.file)
    exe = start(plan, mf, StartOptions(seed=0, lr=1e-3, device=dev))  # preflight at the world of one
    return plan, mf, exe


def probe_zero3_build(device: str, work: Path) -> dict:
    """[B2, M8] ZeRO-3 + parameter offload at world 1: device bytes right after the build, against
    the fp32 model (4 P)."""
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    plan, mf, exe = _build(device, work, zero=3, offload={"params": True, "grads": True, "optimizer": True})
    params = sum(p.numel() for part in exe.parts for p in part.parameters())
    out = {"params": params, "fp32_bytes": 4 * params}
    if device == "cuda":
        out["build_peak_bytes"] = torch.cuda.max_memory_allocated()
    from autopar.executor.runtime.train import train

    result = train(exe, mf, steps=2, seed=0)
    out["losses"] = list(result.losses)
    from autopar.executor.parallel.apply import full_parameters

    # B15: the host-offloaded shards are gathered from the GPU (NCCL takes no host tensors)
    out["full_params"] = sum(t.numel() for t in full_parameters(exe).values())
    return out


def probe_activation_offload(device: str, work: Path) -> dict:
    """[M8] One step with activation offload: bytes copied to the host against the block activations
    the cost model prices for the same plan without offload."""
    from autopar import api
    from autopar.executor.parallel.offload import OffloadSavedTensors
    from autopar.executor.runtime.train import train

    plan, mf, exe = _build(device, work, offload={"activations": True})
    before = OffloadSavedTensors.host_bytes
    train(exe, mf, steps=1, seed=0)
    host = OffloadSavedTensors.host_bytes - before
    weights = sum(p.numel() * p.element_size() for part in exe.parts for p in part.parameters())
    est = api.estimate(None, str(write_plan(work, "act-none", device)))
    return {"host_bytes": host, "weight_bytes": weights, "priced_activation_bytes": est.memory_bytes["activations"],
            "micro_batches": plan.training.global_batch_size // plan.training.micro_batch_size}


def probe_host_optimizer(device: str, work: Path) -> dict:
    """[M8] HostOptimizer.step over about 100M parameters (25 M on the dry run, 4 M with --quick)
    against the priced CPU Adam rate per GPU."""
    import torch
    from torch import nn

    from autopar.cluster import load_cluster
    from autopar.executor.parallel.offload import build_host_optimizer

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    n = 25 if device == "cuda" else 1 if MODEL["quick"] else 6
    params = [nn.Parameter(torch.randn(4 * 2**20, device=dev, dtype=torch.bfloat16)) for _ in range(n)]
    opt = build_host_optimizer(params, lambda ms: torch.optim.AdamW(ms, lr=1e-3), dev)
    times = []
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    cluster = load_cluster(profile_for(device) if device == "cuda" else "h100-80g")
    rate = cluster.cpu_optimizer_params_per_s / cluster.gpus_per_node
    count = sum(p.numel() for p in params)
    return {"params": count, "step_s": min(times[1:]), "priced_s": count / rate, "threads": torch.get_num_threads()}


# -- check 13: where a Llama block's time goes, measured against the price -------------------------

KERNEL_KINDS = ("gemm", "attention", "element-wise")


def _kernel_kind(name: str) -> str:
    """A CUDA kernel's or a CPU aten op's category by its name: GEMM, fused attention, or the
    element-wise rest (norms, rotations, activations, copies, the residual adds)."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                            "aten::matmul", "aten::linear")):
        return "gemm"
    return "element-wise"


def _llama_file(layers: int) -> Path:
    """autopar's Llama at Llama 3 8B's widths (hidden 4096, GQA 32/8, SwiGLU 14336) and 4k tokens, a
    small vocabulary so that the edges stay small; --quick: the same at a toy size."""
    from autopar.models.llama import LlamaConfig
    from autopar.reference_h100 import model_path

    if MODEL["quick"]:
        cfg = LlamaConfig(num_layers=layers, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=160,
                          seq_len=32, vocab_size=128)
    else:
        cfg = LlamaConfig(num_layers=layers, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                          seq_len=4096, vocab_size=1024)
    return model_path(cfg)


def _measured_split_s(path: Path, device: str, dtype: Any, steps: int = 3) -> dict[str, float]:
    """Seconds per forward + backward by kernel kind (device kernels on CUDA, aten ops' own CPU
    time on the CPU), the mean of ``steps`` profiled steps after two warm-ups."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from autopar.modelfile import backward, call_model, load_model_file

    mf = load_model_file(path)
    model = mf.build("cpu").to(device=device, dtype=dtype)
    inputs = mf.example_inputs(1, device)
    loss_fn = mf.loss_fn

    def step() -> None:
        out = call_model(model, inputs)
        backward(loss_fn(out, inputs) if loss_fn is not None else out.float().mean())
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    split = dict.fromkeys(KERNEL_KINDS, 0.0)
    for evt in prof.key_averages():
        if device == "cuda":
            us = evt.self_device_time_total
        else:
            us = evt.self_cpu_time_total if evt.key.startswith("aten::") else 0.0
        split[_kernel_kind(evt.key)] += us * 1e-6 / steps
    return split


def probe_kernel_split(device: str, work: Path) -> dict:
    """Measured seconds per block by kernel kind: the difference of a 4-layer and a 2-layer model,
    halved (the embedding, head and loss cancel)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    two, four = (_measured_split_s(_llama_file(n), device, dtype) for n in (2, 4))
    return {k: (four[k] - two[k]) / 2 for k in KERNEL_KINDS}


def predicted_split_s(device: str) -> tuple[dict[str, float], float, str]:
    """The cost model's seconds per block by kind for the same Llama block on this device's profile
    (autopar run's eager pricing), and the element-wise bytes it moves."""
    from autopar.cluster import load_cluster
    from autopar.cost.compute import is_core, is_parameter_sized, op_time_s
    from autopar.graph import build_graph
    from autopar.graph.scaling import Shape

    profile = profile_for(device)
    cluster = load_cluster(profile)
    graph = build_graph(str(_llama_file(2)), dtype="bf16" if device == "cuda" else "fp32")
    fit = graph.regions["block"]
    shape = Shape(b=1, s_ratio=1.0, kv_ratio=1.0, t=1)
    sequence_model = any(op.bytes_exps.s > 0.5 for op in fit.ops)
    split = dict.fromkeys(KERNEL_KINDS, 0.0)
    moved = 0.0
    for op in fit.ops:
        weight_sized = is_parameter_sized(op, sequence_model)  # at b = 1 at any micro-batch (cost.compute)
        secs, _ = op_time_s(op, shape, cluster, graph.seq_len, weight_sized)
        kind = {"gemm": "gemm", "attn": "attention"}.get(op.kind, "element-wise")
        split[kind] += secs
        if kind == "element-wise" and not is_core(op) and not (weight_sized and cluster.fused_grad_accumulation):
            moved += op.bytes * shape.scale(op.bytes_exps)
    return split, moved, profile


def check_kernel_split(device: str, work: Path) -> Result:
    """13 [cost model] one Llama 3 8B block (4k tokens) timed by kernel kind against its eager price:
    GEMM, attention and element-wise, and the element-wise HBM share the measurement implies (the
    profiles fit 0.23 on published runs; torchtitan's compile gains point higher)."""
    got = _probe("kernel_split", device, work, timeout_s=600)
    pred, moved, profile = predicted_split_s(device)
    parts = [f"{k} {got[k] * 1e3:.2f}/{pred[k] * 1e3:.2f} ms" for k in KERNEL_KINDS]
    text = f"per block measured/priced ({profile}): " + ", ".join(parts)
    if device == "cuda" and got["element-wise"] > 0:
        from autopar.cluster import load_cluster

        bw = load_cluster(profile).memory_bandwidth_bytes_per_s
        text += f"; element-wise HBM share implied {moved / got['element-wise'] / bw:.2f}"
    elif device != "cuda":
        text += " (dry run: a toy model's CPU op times, the 4- minus 2-layer difference is noise, not a figure)"
    return "INFO", text


PROBES: dict[str, Callable[[str, Path], dict]] = {
    "recorder": probe_recorder, "zero3_build": probe_zero3_build, "activation_offload": probe_activation_offload,
    "host_optimizer": probe_host_optimizer, "kernel_split": probe_kernel_split,
}


# -- checks (run in the parent) --------------------------------------------------------------------

Result = tuple[str, str]  # (status, what was measured)


def check_env(device: str, work: Path) -> Result:
    """1 [B9, M5] torch, CUDA and NCCL; the device's memory against the profile's capacity; the
    torch APIs the executor calls."""
    import torch

    from autopar.cluster import load_cluster
    from autopar.executor.runtime.checks import torch_support_reason

    lacking = torch_support_reason()
    text = f"torch {torch.__version__}"
    if device == "cpu":
        return ("FAIL" if lacking else "PASS"), text + ("; " + lacking if lacking else "; executor APIs present")
    total = torch.cuda.get_device_properties(0).total_memory
    cap = load_cluster(profile_for(device)).memory_bytes
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    text += (f", CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.get_device_name(0)}: total {total / GIB:.2f} GiB, "
             f"profile {profile_for(device)} {cap / GIB:.2f} GiB")
    ok = not lacking and abs(total - cap) <= 0.01 * cap
    return ("PASS" if ok else "FAIL"), text + ("; " + lacking if lacking else "")


def check_recorder(device: str, work: Path) -> Result:
    """2 [B7, C1, M5, M4] the flight recorder at world 1 and the measured reserve."""
    from autopar.cluster import load_cluster

    got = _probe("recorder", device, work)
    counts = f"entries: nccl {got.get('_dump_nccl_trace_json')}, generic {got.get('_dump_fr_trace_json')}"
    used = ", ".join(f"{k} {v / GIB:.2f}" for k, v in got.get("used_bytes", []))
    text = f"{counts}; last collective: {got.get('last_collective')}"
    if device == "cuda":
        cluster = load_cluster(profile_for(device))
        text += (f"; device use GiB: {used} (profile prices {cluster.framework_reserve_bytes / GIB:.2f} + "
                 f"{cluster.nccl_bytes_per_group / GIB:.2f} per NCCL group); CPU tensor over NCCL "
                 f"{got.get('cpu_tensor_over_nccl')}")
    return ("PASS" if got.get("last_collective") else "FAIL"), text


_VALIDATED: dict[str, tuple[dict, list[float]]] = {}  # plan -> (report, losses): one run per distinct plan
_VALIDATING: dict[str, threading.Lock] = {}  # plan -> held while it is validated (--jobs: checks 3 and 4 at once)
_VALIDATING_LOCK = threading.Lock()


def _validate(device: str, work: Path, name: str, dtype: str | None = None,
              **parallel: Any) -> tuple[dict, list[float]]:
    # the dry run's fp32 plan (check 3) and its zero-0 plan (check 4) are one plan: validated once
    key = json.dumps(plan_dict(device, dtype, **parallel), sort_keys=True)
    with _VALIDATING_LOCK:
        lock = _VALIDATING.setdefault(key, threading.Lock())
    with lock:
        if key not in _VALIDATED:
            _VALIDATED[key] = _validate_once(device, work, name, dtype, **parallel)
    return _VALIDATED[key]


def _validate_once(device: str, work: Path, name: str, dtype: str | None = None,
                   **parallel: Any) -> tuple[dict, list[float]]:
    plan = write_plan(work, name, device, dtype, **parallel)
    report = work / f"{name}.json"
    steps = "8" if device == "cuda" else "3"
    proc = _autopar(["validate", str(plan), "--steps", steps, "--cluster", profile_for(device),
                     "--report", str(report), "--device", device], device)
    if proc.returncode != 0:
        raise RuntimeError(f"validate {name} exit {proc.returncode}: {(_errors(proc) or [proc.stderr[-300:]])[0]}")
    losses = [float(m) for m in re.findall(r"step \d+/\d+\s+loss ([-\d.e+naif]+)", proc.stderr)]
    return json.loads(report.read_text()), losses


def _against_price(rep: dict) -> str:
    """A validate report's measured memory and step time against the price, as one phrase."""
    mem, t = rep["peak_memory_bytes"], rep["step_time_s"]
    return (f"memory {mem['measured'] / GIB:.3f} vs {mem['predicted'] / GIB:.3f} GiB ({mem['error_pct']:+.1f} %), "
            f"step {t['measured'] * 1e3:.1f} vs {t['predicted'] * 1e3:.1f} ms ({t['error_pct']:+.1f} %)")


def check_validate(device: str, work: Path) -> Result:
    """4 [M2, M4, M20] validate a one-rank bf16 plan, ZeRO 0 (autocast) and ZeRO 3 (FSDP2): memory within
    10 % of the price, finite losses, equal first losses; step time against the price (a measured
    profile's, once check 6 wrote one, is the fair comparison)."""
    import math

    parts, ok = [], True
    first = []
    for zero in (0, 3):
        rep, losses = _validate(device, work, f"validate-zero{zero}", **({"zero": zero} if zero else {}))
        ok &= abs(rep["peak_memory_bytes"]["error_pct"]) <= 10 and bool(losses) and all(math.isfinite(v) for v in losses)
        first.append(losses[0] if losses else float("nan"))
        parts.append(f"zero {zero}: {_against_price(rep)}")
    same = abs(first[0] - first[1]) <= 0.02 * abs(first[0])
    parts.append(f"first losses {first[0]:.4f} / {first[1]:.4f}")
    return ("PASS" if ok and same else "FAIL"), "; ".join(parts)


def check_fp32(device: str, work: Path) -> Result:
    """3 [M9] an fp32 plan: priced at the TF32 peak and run on TF32 tensor cores; step time and memory
    against the price."""
    rep, _ = _validate(device, work, "fp32", "fp32")
    return ("PASS" if abs(rep["peak_memory_bytes"]["error_pct"]) <= 10 else "FAIL"), _against_price(rep)


def check_zero3_build(device: str, work: Path) -> Result:
    """5 [B2, B15] ZeRO-3 + parameter offload: the build holds far less than the fp32 model on the
    device; the host-held shards gather back to full parameters."""
    got = _probe("zero3_build", device, work)
    text = (f"{got['params'] / 1e6:.1f} M params ({got['fp32_bytes'] / GIB:.3f} GiB fp32); losses {got['losses']}; "
            f"{got['full_params'] / 1e6:.1f} M gathered")
    gathered = got["full_params"] >= got["params"]
    if device != "cuda":
        return ("INFO" if gathered else "FAIL"), text + "; device bytes after the build: measured on CUDA only"
    peak = got["build_peak_bytes"]
    return ("PASS" if peak < 0.5 * got["fp32_bytes"] and gathered else "FAIL"), text + f"; build peak {peak / GIB:.3f} GiB"


def check_profile(device: str, work: Path) -> Result:
    """6 [M3, M6, B1] autopar profile at cp 1, 2: ring / all-gather saved bytes against Ulysses, the
    memory bandwidth, kernel overhead and GEMM rate it fits; plan reads the file."""
    import yaml

    out = work / "measured.yaml"
    args = ["profile", str(MODEL["file"]), "--device", device, "--cp", "1,2", "--micro-batch", "1", "-o", str(out)]
    if device == "cpu":
        args += ["--no-comm", "--load-ranks", "1", "--repeats", "3", "--warmup", "1"]
    # --quick: on one core, so the CPU-only contention curve (no GPU profile has one) starts one helper
    # rank, not one per level up to twice the cores
    proc = _autopar(args, device, timeout_s=300, one_core=MODEL["quick"])
    if proc.returncode != 0:
        return "FAIL", f"profile exit {proc.returncode}: {(_errors(proc) or [proc.stderr[-300:]])[0]}"
    m = yaml.safe_load(out.read_text())["measured"]
    saved = {e.get("cp_kind"): e["saved_bytes"] for e in m["layers"]["block"] if e.get("cp") == 2 and e.get("tp", 1) == 1}
    ratio = max(saved.get("ring", 0), saved.get("allgather", 0)) / max(saved.get("ulysses", 1), 1)
    fit = m["fitted"]
    gemm = max(g["flops_per_s"] for g in m["gemm"])
    text = (f"cp 2 saved ring/allgather/ulysses {saved.get('ring', 0) / 2**20:.2f}/{saved.get('allgather', 0) / 2**20:.2f}/"
            f"{saved.get('ulysses', 0) / 2**20:.2f} MiB; bandwidth {fit['memory_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"kernel overhead {fit['kernel_overhead_s'] * 1e6:.1f} us, best GEMM {gemm / 1e12:.1f} TFLOP/s")
    if device == "cuda":
        text += "; " + gemm_table_comparison(m["gemm"], str(m.get("device", {}).get("dtype", "bf16")))
        text += "; " + attention_table_comparison(m.get("attention", []))
    plan = _autopar(["plan", str(MODEL["file"]), "--gpus", "1", "--profile", str(out), "--quiet", "-o", str(work / "p.yaml")],
                    device)
    ok = ratio <= 2.0 and plan.returncode == 0
    if device == "cuda":
        ok &= fit["memory_bandwidth_bytes_per_s"] >= 2.8e12 and fit["kernel_overhead_s"] <= 6e-6 and gemm >= 600e12
    return ("PASS" if ok else "FAIL"), text + f"; plan --profile exit {plan.returncode}"


def gemm_table_comparison(rows: list[dict], dtype: str, profile: str = "h100-80g") -> str:
    """How this GPU's measured GEMM grid (``autopar profile --device cuda``) compares with the
    GEMM table ``profile`` prices from: the median and range of measured / table rate over the
    shapes inside the table's grid (informational: the first GPU run checks the published table)."""
    import statistics

    from autopar.cluster import load_cluster

    published = load_cluster(profile).gemm_table
    if published is None or dtype not in published.dtypes():
        return f"{profile} has no {dtype} GEMM table"
    inside = [r for r in rows if published.m[0] <= r["m"] <= published.m[-1] and published.n[0] <= r["n"] <= published.n[-1]
              and published.k[0] <= r["k"] <= published.k[-1]]
    ratios = [r["flops_per_s"] / published.rate(r["m"], r["n"], r["k"], dtype) for r in inside]
    if not ratios:
        return f"no measured GEMM inside {profile}'s GEMM table"
    return (f"GEMM measured / {profile}'s table: median {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} shapes")


def attention_table_comparison(rows: list[dict], profile: str = "h100-80g") -> str:
    """How this GPU's measured flash-attention rates (``autopar profile --device cuda``) compare with
    the attention table ``profile`` prices from, at its kernel: the median and range of measured /
    table rate over the measured points (informational: the first GPU run checks the published
    table; the profile then prices from its own rows)."""
    import statistics

    from autopar.cluster import load_cluster

    c = load_cluster(profile)
    if c.attention_table is None or not rows:
        return "no attention rows measured" if not rows else f"{profile} has no attention table"
    ratios = [r["flops_per_s"] / c.attention_table.rate(c.attention_kernel, backward=r["direction"] == "backward",
                                                        causal=r["mask"] == "causal", kv_tokens=r["kv_tokens"],
                                                        head_dim=r["head_dim"]) for r in rows]
    return (f"attention measured / {profile}'s {c.attention_kernel} table: median {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} points")


def check_activation_offload(device: str, work: Path) -> Result:
    """7 [M8] activation offload copies the activations, not the weights."""
    got = _probe("activation_offload", device, work)
    priced = got["priced_activation_bytes"]
    text = (f"host {got['host_bytes'] / 2**20:.1f} MiB in one step ({got['micro_batches']} micro-batches), priced "
            f"activations {priced / 2**20:.1f} MiB per micro-batch in flight, weights {got['weight_bytes'] / 2**20:.1f} MiB")
    per_mb = got["host_bytes"] / max(got["micro_batches"], 1)
    return ("PASS" if per_mb <= 1.1 * priced else "FAIL"), text


def check_host_optimizer(device: str, work: Path) -> Result:
    """8 [M8] the host optimizer's step against its priced rate."""
    got = _probe("host_optimizer", device, work)
    text = (f"{got['params'] / 1e6:.0f} M params: step {got['step_s']:.3f} s vs priced {got['priced_s']:.3f} s "
            f"({got['threads']} threads)")
    if device != "cuda":
        return "INFO", text + " (the priced rate is an H100 host's)"
    return ("PASS" if got["step_s"] <= 3 * got["priced_s"] else "FAIL"), text


def check_fp16(device: str, work: Path) -> Result:
    """9 [B5] fp16 has no loss scaler: refused in one line, exit 2."""
    path = write_plan(work, "fp16", device, "fp16")
    proc = _autopar(["run", str(path), "--steps", "1", "--device", device], device)
    errs = _errors(proc)
    ok = proc.returncode == 2 and len(errs) == 1 and "loss scaling" in errs[0]
    return ("PASS" if ok else "FAIL"), f"exit {proc.returncode}: {errs[0][:120] if errs else proc.stderr[-200:]}"


def check_oom(device: str, work: Path) -> Result:
    """10 [B6] an out-of-memory ends in one line, exit 3, within seconds."""
    path = write_plan(work, "oom", device)
    t0 = time.perf_counter()
    proc = _autopar(["run", str(path), "--steps", "3", "--device", device], device,
                    env={"AUTOPAR_TEST_OOM_AT_STEP": "1", "AUTOPAR_TEST_OOM_RANK": "0"})
    took = time.perf_counter() - t0
    errs = _errors(proc)
    ok = proc.returncode == 3 and len(errs) == 1 and "ran out of device memory" in errs[0]
    text = f"exit {proc.returncode} after {took:.1f} s: {errs[0][:110] if errs else proc.stderr[-200:]}"
    if device == "cuda":  # torch's own error type from a real allocation, the one rank_main catches
        import torch

        try:
            torch.empty(int(torch.cuda.get_device_properties(0).total_memory * 2), dtype=torch.uint8, device="cuda")
            ok, text = False, text + "; a 2x-capacity allocation succeeded?"
        except torch.OutOfMemoryError:
            text += "; a real 2x-capacity allocation raised torch.OutOfMemoryError"
    return ("PASS" if ok else "FAIL"), text


def check_device_override(device: str, work: Path) -> Result:
    """11 [B8] more ranks than GPUs, or --device cuda without one: one line, exit 2."""
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        path = write_plan(work, "too-many", device, dp=n + 1)
        proc = _autopar(["run", str(path), "--steps", "1", "--device", "cuda"], device)
    else:
        path = write_plan(work, "no-gpu", device)
        proc = _autopar(["run", str(path), "--steps", "1", "--device", "cuda"], "cuda")
    errs = _errors(proc)
    ok = proc.returncode == 2 and len(errs) == 1 and "Traceback" not in proc.stderr
    return ("PASS" if ok else "FAIL"), f"exit {proc.returncode}: {errs[0][:140] if errs else proc.stderr[-200:]}"


def check_timing(device: str, work: Path) -> Result:
    """12 [C4, M11] ten steps: steps 3-10 within 5 % of each other."""
    path = write_plan(work, "timing", device)
    report = work / "timing.json"
    steps = 10 if device == "cuda" else 5  # the dry run checks the code path, its CPU timings mean nothing
    proc = _autopar(["run", str(path), "--steps", str(steps), "--device", device, "--report", str(report)], device)
    if proc.returncode != 0:
        return "FAIL", f"run exit {proc.returncode}: {(_errors(proc) or [proc.stderr[-200:]])[0]}"
    rep = json.loads(report.read_text())
    times = rep.get("step_times_s") or rep.get("step_time_s", {}).get("all_steps_s") or []
    steady = sorted(times[2:])
    if not steady:
        return "FAIL", f"no step times in the run report ({sorted(rep)[:8]})"
    spread = (steady[-1] - steady[0]) / steady[len(steady) // 2]
    text = f"steps 3-{steps}: {steady[0] * 1e3:.1f}-{steady[-1] * 1e3:.1f} ms, spread {spread * 100:.1f} %"
    if device != "cuda":
        return "INFO", text + " (CPU timings move 20-40 % on a shared machine)"
    return ("PASS" if spread <= 0.05 else "FAIL"), text


def check_ring_pieces(device: str, work: Path) -> Result:
    """14 [B13] ring / all-gather attention's pieces on this device's kernels, at bf16 (CUDA: the
    FlashAttention-2 kernels, a chunk's strided log-sum-exp into the backward) and at fp32 (CUDA:
    explicit scores, which FlashAttention-2 cannot take): one rank's two-chunk causal shard merged
    by log-sum-exp, forward and backward, against ``scaled_dot_product_attention`` in fp32."""
    import torch
    import torch.nn.functional as F

    from autopar.executor.parallel import ring_attention as ra

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    b, h, kv, s, d = 1, 8, 2, 128 if MODEL["quick"] else 512, 64
    chunks = [(0, s // 2), (s // 2, s // 2)]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, n, s, d, generator=g).to(dev) for n in (h, kv, kv, h))
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    want = [ref.detach(), qr.grad, kr.grad, vr.grad]
    parts, worst = [], 0.0
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 1e-4)):
        ql, kl, vl, dl = (t.to(dtype) for t in (q, k, v, dout))
        merge = ra._Merge(ql, chunks, d ** -0.5)
        merge.add(kl, vl, chunks)
        out, lse = merge.result()
        dq = torch.zeros(ql.shape, dtype=torch.float32, device=dev)
        dkv = ra._block_backward(dl, ql, out, lse, chunks, kl, vl, chunks, d ** -0.5, dq)
        got = [out, dq, dkv[0], dkv[1]]
        err = max(float((x.float() - y).abs().max() / y.abs().max().clamp_min(1e-6)) for x, y in zip(got, want))
        worst = max(worst, err / tol)
        parts.append(f"{str(dtype).removeprefix('torch.')} max rel {err:.1e} (tol {tol:.0e})")
    text = f"{b}x{h}/{kv} heads x {s} tokens x {d}, two chunks: " + ", ".join(parts)
    return ("PASS" if worst <= 1.0 else "FAIL"), text + "; " + _strided_lse_answer(dev, h, s, d)


def _strided_lse_answer(dev: Any, heads: int, s: int, d: int) -> str:
    """B14's open question: does the device's flash backward read a strided log-sum-exp (the second
    chunk's slice) right? autopar hands it a dense copy either way; this only records the answer."""
    import torch

    from autopar.executor.parallel import ring_attention as ra

    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, heads, s, d, generator=g).to(dev, torch.bfloat16) for _ in range(4))
    out, lse = ra._flash(q, k, v, True, d ** -0.5)
    half = slice(s // 2, s)
    args = [t[:, :, half] for t in (dout, q, k, v, out)]
    strided = lse[:, :, half]
    if dev.type == "cuda":
        none = torch.empty(0, dtype=torch.int64, device=dev)

        def bwd(lse_part: Any) -> Any:
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                *args, lse_part, none, none, s // 2, s // 2, 0.0, True, none, none, scale=d ** -0.5)
    else:
        def bwd(lse_part: Any) -> Any:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *args, lse_part, 0.0, True, scale=d ** -0.5)
    # FlashAttention-2's dq accumulates by atomics: two runs differ in the last bits, a misread
    # log-sum-exp by the size of the gradients
    rel = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
              for a, b in zip(bwd(strided), bwd(strided.contiguous())))
    verdict = "the same gradients as" if rel < 1e-2 else "DIFFERENT gradients from"
    return f"B14: a strided log-sum-exp gives {verdict} a dense one (max rel {rel:.1e})"


CHECKS: list[tuple[int, str, Callable[[str, Path], Result]]] = [
    (1, "environment", check_env), (2, "flight recorder + reserve", check_recorder),
    (3, "fp32 on TF32", check_fp32), (4, "validate zero 0 / 3", check_validate), (5, "ZeRO-3 offload build", check_zero3_build),
    (6, "profile", check_profile), (7, "activation offload", check_activation_offload),
    (8, "optimizer offload", check_host_optimizer), (9, "fp16 refused", check_fp16), (10, "out of memory", check_oom),
    (11, "device override", check_device_override), (12, "timing", check_timing),
    (13, "kernel split (Llama block)", check_kernel_split), (14, "ring attention pieces", check_ring_pieces),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present")
    ap.add_argument("--only", default="", help="comma-separated check numbers")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="with --device cpu only: the dry run on a tiny model (examples/zoo/autopar_gpt.py, gpt_small's "
                         "GPT at 4 layers) -- every check's steps in a fraction of the time, its figures meaningless")
    ap.add_argument("--jobs", type=int, default=1,
                    help="with --device cpu only: run up to N checks at once (a dry run's figures mean nothing, and "
                         "most of its time is the commands' process starts); results are printed in check order")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        if args.device != "cpu":
            ap.error("--quick is for the dry run (--device cpu): a GPU run checks gpt_small")
        use_quick_model()
    if args.jobs < 1 or (args.jobs > 1 and args.device != "cpu"):
        ap.error("--jobs N (N >= 1) above 1 is for the dry run (--device cpu): a GPU run's checks measure alone")
    if args.probe:
        print(json.dumps(PROBES[args.probe](args.device, Path(args.work))))
        return 0
    only = {int(x) for x in args.only.split(",") if x.strip()}
    rows, results, t_all = [], [], time.perf_counter()
    todo = [(number, name, fn) for number, name, fn in CHECKS if not only or number in only]
    with tempfile.TemporaryDirectory(prefix="autopar-gpu-acceptance-") as tmp:

        def one(number: int, name: str, fn: Callable[[str, Path], Result]) -> dict:
            t0 = time.perf_counter()
            try:
                status, text = fn(args.device, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - one check's failure is its row, not the run's end
                status, text = "FAIL", f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            return {"check": number, "name": name, "status": status, "measured": text,
                    "seconds": time.perf_counter() - t0}

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            # --jobs N: the checks' files in the shared folder have names of their own, and each runs its
            # commands in processes of their own; --jobs 1: each check in this thread, in turn
            done = ([pool.submit(one, *check).result for check in todo] if args.jobs > 1 else
                    [lambda check=check: one(*check) for check in todo])
            for answer in done:
                row = answer()
                results.append(row)
                print(f"{row['check']:>2}  {row['name']:<26} {row['status']:<4}  {row['seconds']:5.1f} s  "
                      f"{row['measured']}", flush=True)
                rows.append(row["status"])
    fails = rows.count("FAIL")
    print(f"{len(rows)} checks on {args.device} in {time.perf_counter() - t_all:.0f} s: "
          f"{rows.count('PASS')} pass, {fails} fail, {rows.count('INFO')} info, {rows.count('SKIP')} skipped")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "checks": results}, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
