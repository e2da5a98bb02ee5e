"""The cost model's peak memory against a rehearsal of the real executor, at full scale.

For each case (a model and a GPU count), the top plan of ``autopar plan`` on the executor's own
profile (``h100-80g``: autopar run / FSDP2) is rehearsed (``autopar rehearse``: every pipeline
stage's first rank, on fake tensors over a fake process group) and the cost model's peak per stage
is printed beside the rehearsed one. The error is over tensor bytes (the reserve the profile adds
for the CUDA context and communication buffers is the same on both sides). Target: within 5 % for
GPT-3 175B, Llama-3 70B and 405B at 64 and 1,024 GPUs and for zoo models -- block lists, layer chains
(DeepSeek-V2-Lite, T5, ResNet-152) and expert parallelism (DeepSeek-V2-Lite, Mixtral-8x7B) (docs/rehearse.md).

    python benchmarks/rehearse_memory.py [--cases gpt3-175b@64,...] [--cluster h100-80g]

Layer chains and experts: ``--cases hf-deepseek@64,hf-t5@64,resnet@64,hf-mixtral@64``.

A case ``model@gpus:mode`` plans with recompute ``mode`` only (``llama3-8b@8:op``: torchtitan's Llama
3.1 8B FSDP run of calibration/h100_public.yaml, per-op selective recompute, global batch 16 of
micro-batches of 2 as it ran).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autopar import api  # noqa: E402
from autopar.models.llama import LlamaConfig, model_file  # noqa: E402
from autopar.report import table  # noqa: E402

LLAMA3_8B = LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                        seq_len=8192, vocab_size=128256)
BATCH = {"llama3-8b": dict(global_batch=16, micro_batch=[2])}  # torchtitan's run (calibration/h100_public.yaml)
LLAMA3_405B = LlamaConfig(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248,
                          seq_len=8192, vocab_size=128256)
ZOO = {"hf-llama": "hf_llama.py", "hf-mixtral": "hf_mixtral.py", "vit": "vit.py", "torch-encoder": "torch_encoder.py",
       # layer chains (no repeated block list): DeepSeek-V2-Lite (a dense layer, then MoE layers),
       # T5 (encoder and decoder), ResNet-152 (four stages of differing blocks)
       "hf-deepseek": "hf_deepseek_v3.py", "hf-t5": "hf_t5.py", "resnet": "resnet.py"}
DEFAULT_CASES = ("gpt3-175b@64", "llama3-70b@64", "llama3-405b@64", "gpt3-175b@1024", "llama3-70b@1024",
                 "llama3-405b@1024", "hf-llama@64", "vit@64", "torch-encoder@64",
                 "hf-deepseek@64", "hf-mixtral@64", "hf-t5@64", "resnet@64")
GIB = 2**30


def model_path(name: str, work: Path) -> str:
    if name == "gpt3-175b":
        return str(REPO / "examples" / "gpt.py")
    if name == "llama3-70b":
        return str(REPO / "examples" / "llama.py")
    if name in ("llama3-8b", "llama3-405b"):
        path = work / f"{name.replace('-', '_')}.py"
        path.write_text(model_file(LLAMA3_8B if name == "llama3-8b" else LLAMA3_405B), encoding="utf-8")
        return str(path)
    if name in ZOO:
        text = (REPO / "examples" / "zoo" / ZOO[name]).read_text(encoding="utf-8")
        path = work / ZOO[name]
        path.write_text(text.replace('SIZE = "tiny"', 'SIZE = "full"'), encoding="utf-8")
        return str(path)
    raise SystemExit(f"unknown model {name}; known: gpt3-175b, llama3-8b, llama3-70b, llama3-405b, {', '.join(ZOO)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="model@gpus, comma-separated")
    ap.add_argument("--cluster", default="h100-80g")
    args = ap.parse_args()
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            name, _, rest = case.partition("@")
            gpus, _, mode = rest.partition(":")
            path = model_path(name, Path(tmp))
            options = dict(BATCH.get(name, {}), **({"recompute_modes": (mode,)} if mode else {}))
            t0 = time.perf_counter()
            plan = api.plan(path, int(gpus), args.cluster, top=1, **options)
            plan_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            reh = api.rehearsal(plan, path, args.cluster,
                                progress=lambda text: print(f"  {case}: {text}", file=sys.stderr, flush=True))
            reh_s = time.perf_counter() - t0
            par = plan.parallel
            layout = (f"dp{par.dp} tp{par.tp} pp{par.pp} cp{par.cp}{f' ep{par.ep}' if par.ep > 1 else ''} z{par.zero} "
                      f"mb{plan.training.micro_batch_size} {par.recompute if par.recompute_blocks is None else 'mixed'}")
            for r in reh.ranks:
                worst = max(worst, abs(r.tensor_error_pct))
                rows.append([case, layout if r is reh.ranks[0] else "", r.stage, f"{r.predicted_peak_bytes / GIB:.2f}",
                             f"{r.peak_bytes / GIB:.2f}", f"{r.tensor_error_pct:+.1f}",
                             f"{plan_s:.1f}" if r is reh.ranks[0] else "", f"{reh_s:.0f}" if r is reh.ranks[0] else ""])
            # each case's figures as it ends, so a long run that stops early keeps what it measured
            errors = " ".join(f"stage {r.stage} {r.predicted_peak_bytes / GIB:.2f}/{r.peak_bytes / GIB:.2f} GiB "
                              f"{r.tensor_error_pct:+.1f} %" for r in reh.ranks)
            print(f"  {case}: done in {reh_s:.0f} s ({layout}; predicted/rehearsed: {errors})", file=sys.stderr, flush=True)
    print(table(["case", "top plan", "stage", "predicted GiB", "rehearsed GiB", "error %", "plan s", "rehearse s"],
                rows, align="llrrrrrr"))
    print(f"\nlargest |error| {worst:.1f} % (target 5 %) on {args.cluster}; error over tensor bytes "
          "(the profile's reserve is added to both sides)")
    return 0 if worst <= 5.0 else 1


if __name__ == "__main__":
    sys.exit(main())
