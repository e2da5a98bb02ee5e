"""The memory price of every kind of layout against a rehearsal of the executor, one layout at a time.

    python benchmarks/rehearse_layouts.py [--cases dp8-z0,tp4-sp,...] [--model gpt|llama] [--cluster h100-80g]

``benchmarks/rehearse_memory.py`` checks the plans the search ranks first at full scale; a user
also pins layouts the search would not choose (``plan --tp 4 --zero 2``), and each data-, tensor-,
pipeline-, context-parallel mechanism, ZeRO stage, schedule, recompute mode and offload holds its
own tensors. Here each case pins one such layout on 8 ranks of a mid-size decoder (16 blocks,
hidden 1024, sequence 1024: activations and model states of comparable size, so neither hides the
other), lets the search choose the rest, and rehearses the first rank of every pipeline stage on
a fake process group (autopar.rehearse). Prints one row per rehearsed rank (predicted and
rehearsed tensor bytes, error) and, per case, the parts that differ most (``rehearse --why``'s
parts: params, grads, optimizer, activations, temporaries); exits 1 where a rank is off by more
than 5 %.
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

GIB = 2**30
# (name, constraints): one mechanism each; the search chooses what a case leaves open
CASES: dict[str, dict[str, list]] = {
    "dp8-z0": dict(dp=[8], zero=[0], recompute=["none"]),
    "dp8-z1": dict(dp=[8], zero=[1], recompute=["none"]),
    "dp8-z2": dict(dp=[8], zero=[2], recompute=["none"]),
    "dp8-z3": dict(dp=[8], zero=[3], recompute=["none"]),
    "tp4-sp": dict(dp=[2], tp=[4], sp=[True], zero=[1], recompute=["none"]),
    "tp4-nosp": dict(dp=[2], tp=[4], sp=[False], zero=[1], recompute=["none"]),
    "tp2-selective": dict(dp=[4], tp=[2], zero=[1], recompute=["selective"]),
    "dp8-full": dict(dp=[8], zero=[3], recompute=["full"]),
    "dp8-op": dict(dp=[8], zero=[1], recompute=["op"]),
    "cp2-ring": dict(dp=[4], cp=[2], cp_kind=["ring"], zero=[1], recompute=["none"]),
    "cp2-allgather": dict(dp=[4], cp=[2], cp_kind=["allgather"], zero=[1], recompute=["none"]),
    "cp2-ulysses": dict(dp=[4], cp=[2], cp_kind=["ulysses"], zero=[1], recompute=["none"]),
    "pp4-gpipe": dict(dp=[2], pp=[4], schedule=["gpipe"], zero=[1], recompute=["none"]),
    "pp4-1f1b-z3": dict(dp=[2], pp=[4], schedule=["1f1b"], zero=[3], recompute=["none"]),
    "pp2-v2-z1": dict(dp=[4], pp=[2], schedule=["interleaved-1f1b"], virtual_stages=[2], zero=[1],
                      recompute=["none"]),
    "pp2-v4-z1": dict(dp=[4], pp=[2], schedule=["interleaved-1f1b"], virtual_stages=[4], zero=[1],
                      recompute=["none"]),
    "pp2-v4-z3": dict(dp=[4], pp=[2], schedule=["interleaved-1f1b"], virtual_stages=[4], zero=[3],
                      recompute=["none"]),
    "tp2-pp2-mixed": dict(dp=[2], tp=[2], pp=[2], zero=[1], recompute=["mixed"]),
    "dp8-offload": dict(dp=[8], zero=[3], offload=["optimizer"], recompute=["none"]),
}
LLAMA = LlamaConfig(num_layers=16, hidden_size=1024, num_heads=16, num_kv_heads=4, ffn_hidden_size=2816,
                    seq_len=1024, vocab_size=32000)


def model_path(name: str, work: Path) -> str:
    if name == "llama":
        path = work / "llama_mid.py"
        path.write_text(model_file(LLAMA), encoding="utf-8")
        return str(path)
    text = (REPO / "examples" / "gpt_small.py").read_text(encoding="utf-8")
    text = text.replace("num_layers=8, hidden_size=256, num_heads=8, seq_len=128, vocab_size=1024",
                        "num_layers=16, hidden_size=1024, num_heads=16, seq_len=1024, vocab_size=32000")
    path = work / "gpt_mid.py"
    path.write_text(text, encoding="utf-8")
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--cluster", default="h100-80g")
    args = ap.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        print(f"rehearse_layouts: unknown case {unknown[0]!r}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        for name in names:
            t0 = time.perf_counter()
            try:
                plan = api.plan(path, 8, args.cluster, top=1, global_batch=32, micro_batch=[1, 2],
                                constraints=CASES[name], use_cache=False)
            except Exception as exc:  # noqa: BLE001 -- a layout that does not fit is a row, not a crash
                rows.append([name, f"not planned: {str(exc).splitlines()[0][:60]}", "", "", "", "", "", ""])
                continue
            reh = api.rehearsal(plan, path, args.cluster)
            took = time.perf_counter() - t0
            par = plan.parallel
            layout = (f"dp{par.dp} tp{par.tp} pp{par.pp} cp{par.cp} z{par.zero} mb{plan.training.micro_batch_size} "
                      f"{par.pp_schedule if par.pp > 1 else ''}{f' v{par.pp_virtual_stages}' if par.pp_virtual_stages > 1 else ''}"
                      f" {par.recompute if par.recompute_blocks is None else 'mixed'}")
            for r in reh.ranks:
                worst = max(worst, abs(r.tensor_error_pct))
                held = {("other" if k == "temporaries" else k): v for k, v in r.parts.items() if k != "reserve"}
                priced = dict(r.predicted_parts, other=r.predicted_parts.get("other", 0.0) - r.reserve_bytes)
                diffs = sorted(((priced.get(k, 0.0) - v, k) for k, v in held.items()), key=lambda x: -abs(x[0]))
                parts = ", ".join(f"{k} {d / GIB:+.2f}" for d, k in diffs[:2])
                rows.append([name if r is reh.ranks[0] else "", layout if r is reh.ranks[0] else "", r.stage,
                             f"{r.predicted_peak_bytes / GIB:.2f}", f"{r.peak_bytes / GIB:.2f}",
                             f"{r.tensor_error_pct:+.1f}", parts, f"{took:.0f}" if r is reh.ranks[0] else ""])
            print(f"  {name}: {layout}: " + " ".join(f"stage {r.stage} {r.tensor_error_pct:+.1f} %" for r in reh.ranks),
                  file=sys.stderr, flush=True)
    print(table(["case", "layout", "stage", "predicted GiB", "rehearsed GiB", "error %",
                 "parts most apart (predicted - rehearsed, GiB)", "s"], rows, align="llrrrrll"))
    print(f"\nlargest |error| {worst:.1f} % (target 5 %) on {args.cluster}, {args.model}; error over tensor bytes; "
          "parts: the rehearsal's temporaries against the price's other less the reserve; the rehearsal "
          "counts FSDP2's fp32 master shards as params and fp32 gradient accumulators as temporaries")
    return 0 if worst <= 5.0 else 1


if __name__ == "__main__":
    sys.exit(main())
