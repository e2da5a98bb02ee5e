"""The model zoo's shared machinery: find the zoo's model files, ask autopar what it offers for each,
plan the full size at 64 GPUs, and run the tiny size under a plan against one rank.

Used by ``benchmarks/model_zoo.py`` (the acceptance table) and ``tests/zoo/test_zoo.py`` (the CI subset),
so both judge a model the same way. Everything autopar does here runs in a subprocess with a time
limit: a model whose tracing hangs, or a run whose ranks deadlock, becomes a failure cell, never a
hang of the benchmark. The one function that asks autopar what a model supports is ``_support_child``;
it runs in a child (``python benchmarks/zoo_lib.py --support FILE``) for the same reason, which with
``--reference WORK_DIR`` goes on to the model's one-rank reference run (``support_and_reference``).

Cells are ``Cell`` values: ``ok``, ``FAIL`` (a one-line cause, plus the tail of the output for the
failure log) or ``n/a`` (the reason the dimension is not offered).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]
ZOO_DIR = REPO / "examples" / "zoo"
SUPPORT_KEYS = ("tp", "sp", "pp", "cp", "zero3", "ep")
# Run cells: name -> the plan's parallel section (2 ranks), and the support keys it needs.
RUNS: dict[str, dict[str, Any]] = {
    "dp2": {"dp": 2},
    "tp2+sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "cp2": {"cp": 2},
    "zero3": {"dp": 2, "zero": 3},
    "ep2": {"dp": 2, "ep": 2},  # expert parallelism: the experts of each block over the 2 ranks
}
RUN_NEEDS: dict[str, tuple[str, ...]] = {"dp2": (), "tp2+sp": ("tp",), "pp2": ("pp",), "cp2": ("cp",), "zero3": ("zero3",),
                                         "ep2": ("ep",)}
STEPS, GLOBAL_BATCH, MICRO_BATCH, RTOL = 3, 4, 1, 1e-4
PLAN_TIMEOUT_S, SUPPORT_TIMEOUT_S, RUN_TIMEOUT_S = 90.0, 90.0, 180.0
_OPTIONAL_PACKAGES = ("transformers",)


# What a demanding user expects autopar to offer for a zoo model: pipeline and ZeRO-3 for
# every model, tensor parallelism (and Megatron SP) for every transformer whose projections are Linear
# layers. CP is not expected anywhere: it is offered only where the executor knows the attention.
_NO_TP_EXPECTED = {"resnet": "a conv net", "torch_unet": "a conv net", "torch_efficientnet": "a conv net",
                   "wrapped_mha_lm": "nn.MultiheadAttention packs q/k/v in one Parameter"}


def expected_offers(name: str) -> frozenset[str]:
    """The support keys the zoo expects autopar to offer for model ``name``."""
    return frozenset({"pp", "zero3"} | (set() if name in _NO_TP_EXPECTED else {"tp", "sp"}))


class ZooError(Exception):
    """A zoo step failed: ``cause`` is one line, ``tail`` the end of the output for the failure log."""

    def __init__(self, cause: str, tail: str = "") -> None:
        super().__init__(cause)
        self.cause, self.tail = cause, tail


@dataclass(frozen=True, kw_only=True)
class Cell:
    status: str  # "ok" | "FAIL" | "n/a"
    detail: str = ""
    seconds: float | None = None
    tail: str = field(default="", compare=False)
    expected: bool = False  # n/a although the zoo expects the dimension offered (expected_offers)

    def __post_init__(self) -> None:
        if self.status not in ("ok", "FAIL", "n/a"):
            raise ValueError(f"Cell.status must be ok, FAIL or n/a, got {self.status!r}")

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    @property
    def missing_offer(self) -> bool:
        return self.status == "n/a" and self.expected

    def __str__(self) -> str:
        status = self.status + ("*" if self.missing_offer else "")
        return status if not self.detail else f"{status}({self.detail})"


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    name: str
    path: Path
    requires: tuple[str, ...]

    def missing(self) -> str | None:
        """Why this model cannot be tried here (an optional package is not installed), else None."""
        absent = [p for p in self.requires if importlib.util.find_spec(p) is None]
        return f"{', '.join(absent)} not installed" if absent else None


@dataclass(frozen=True, kw_only=True)
class Support:
    """What autopar offers for a model file: ``support[key]`` None = offered, else the reason."""

    num_blocks: int
    seq_len: int | None
    support: Mapping[str, str | None]
    tp_source: str | None = None
    source: str = "graph"  # "spec" (autopar.spec.model_spec) or "graph" (build_graph's reasons)

    def reason(self, key: str) -> str | None:
        return self.support.get(key, "not reported by autopar")


def zoo_models(names: Sequence[str] | None = None) -> list[ZooModel]:
    """The zoo's model files, sorted by name (``names`` selects; an unknown name is a ValueError)."""
    found = {}
    for p in sorted(ZOO_DIR.glob("*.py")):
        if p.name.startswith("_"):
            continue
        text = p.read_text(encoding="utf-8")
        req = tuple(pkg for pkg in _OPTIONAL_PACKAGES if re.search(rf"^\s*(from|import)\s+{pkg}\b", text, re.M))
        found[p.stem] = ZooModel(name=p.stem, path=p, requires=req)
    if not names:
        return list(found.values())
    unknown = [n for n in names if n not in found]
    if unknown:
        raise ValueError(f"unknown zoo model(s) {', '.join(unknown)}; known: {', '.join(found)}")
    return [found[n] for n in names]


def with_size(path: Path, size: str, out_dir: Path) -> Path:
    """A copy of the model file with ``SIZE = "<size>"`` (same file name, so the same model name; the
    content differs, so a graph cache keyed on the file's hash does not mix sizes)."""
    text = path.read_text(encoding="utf-8")
    new, n = re.subn(r'^SIZE = "\w+"', f'SIZE = "{size}"', text, count=1, flags=re.M)
    if n != 1:
        raise ZooError(f"{path.name} has no SIZE = \"...\" line")
    out = Path(out_dir) / path.name
    out.write_text(new, encoding="utf-8")
    return out


def _env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd: list[str], timeout_s: float, cwd: Path, env: Mapping[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` (in ``env``, default this process's environment now); (exit code, stdout+stderr,
    seconds). A timeout kills the whole process group."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise ZooError(f"timed out after {timeout_s:.0f} s", _tail(out)) from None
    return proc.returncode, out, time.perf_counter() - start


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_ERROR_LINE = re.compile(r"^\s*(?:\[(?:rank|default)\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")
# Consequences, not causes: a peer that died first, torchrun's summary, a rank killed by its launcher.
_SECONDARY = re.compile(r"lost a peer|Connection closed by peer|ChildFailedError|torch\.distributed\.elastic|"
                        r"SignalException|Connection reset|Broken pipe|timed out waiting|"
                        r"aborted by peer|another rank", re.I)


def _causes(output: str) -> list[tuple[int, str]]:
    found = []
    for i, line in enumerate(output.splitlines()):
        if "autopar: error:" in line:
            found.append((i, line.split("autopar: error:", 1)[1].strip()))
        else:
            m = _ERROR_LINE.match(line)
            if m:
                found.append((i, m.group(1).strip()))
    return found


def one_line_cause(output: str, code: int) -> str:
    """The most telling line of a failed command: the first error that is not a consequence of another
    rank's failure (autopar's one-line error or an exception line), else the last error, else the tail."""
    found = _causes(output)
    primary = [c for _, c in found if not _SECONDARY.search(c)]
    if primary:
        return primary[0]
    if found:
        return found[-1][1]
    lines = output.splitlines()
    return f"exit {code}: {lines[-1].strip() if lines else 'no output'}"


_NOISE = re.compile(r"^\s*(?:\[rank\d+\]:)?\s*[\^~ ]+$|/torch/nn/modules/module\.py\", line \d+, in _(?:wrapped_)?call_impl|"
                    r"^\s*(?:\[rank\d+\]:)?\s*return (?:self\._call_impl|forward_call)\(")


def failure_excerpt(output: str, before: int = 12, after: int = 2, tail: int = 6) -> str:
    """The lines leading to the first primary error, and the last lines: enough to see where it broke
    (caret markers and nn.Module's call wrappers left out)."""
    lines = [ln for ln in output.rstrip().splitlines() if not _NOISE.search(ln)]
    found = [i for i, c in _causes("\n".join(lines)) if not _SECONDARY.search(c)]
    if not found:
        return "\n".join(lines[-(before + tail):])
    i = found[0]
    head = lines[max(0, i - before): i + after + 1]
    rest = lines[-tail:] if len(lines) - tail > i + after + 1 else []
    return "\n".join(head + (["..."] + rest if rest else []))


_WORK_PATH = re.compile(r"\S*/zoo-[\w-]+/(?:full|tiny)/")


def _short(text: str, limit: int = 160) -> str:
    text = _WORK_PATH.sub("", " ".join(text.split()))  # the temporary copy's directory says nothing
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- support
def _own_model_spec():
    """autopar.spec.model_spec from the same source tree as ``autopar`` itself, else None. (An editable
    install's finder can resolve a submodule from another checkout; that would mix two trees.)"""
    import autopar

    try:
        import autopar.spec as spec_mod
    except ImportError:
        return None
    pkg = Path(autopar.__file__).resolve().parent
    if not Path(spec_mod.__file__).resolve().is_relative_to(pkg):
        return None
    return getattr(spec_mod, "model_spec", None)


def _support_child(path: str) -> dict[str, Any]:
    """(In the child.) What autopar offers for the model file at ``path``: autopar.spec.model_spec when
    it exists, else the planner graph's reasons. The one place to change when autopar's API changes."""
    from autopar.graph import build_graph
    from autopar.modelfile import load_model_file

    mf = load_model_file(path)
    model_spec = _own_model_spec()
    if model_spec is not None:
        spec = model_spec(mf)
        num_blocks = getattr(spec, "num_blocks", None) or build_graph(mf, dtype="fp32").num_blocks
        tp = getattr(spec, "tp", None)
        return {"num_blocks": num_blocks, "seq_len": mf.seq_len, "source": "spec",
                "support": {k: spec.support.get(k, "not reported by model_spec") for k in SUPPORT_KEYS},
                "tp_source": getattr(spec, "tp_source", None) or getattr(tp, "source", None)}
    g = build_graph(mf, dtype="fp32")
    support = {"tp": g.tp_reason, "sp": g.tp_reason, "pp": g.pp_reason, "cp": g.cp_reason, "zero3": None}
    return {"num_blocks": g.num_blocks, "seq_len": mf.seq_len, "source": "graph", "support": support,
            "tp_source": "declared" if mf.tp_plan else None}


_MARKER = "ZOO-SUPPORT "


def _support_from(d: Mapping[str, Any]) -> Support:
    return Support(num_blocks=d["num_blocks"], seq_len=d["seq_len"], support=d["support"],
                   tp_source=d.get("tp_source"), source=d["source"])


def support_of(path: Path, timeout_s: float = SUPPORT_TIMEOUT_S) -> Support:
    """Ask autopar (in a child with a time limit) what it offers for ``path``; ZooError if it cannot say."""
    code, out, _ = _run([sys.executable, str(Path(__file__).resolve()), "--support", str(path)], timeout_s, REPO)
    marker = [ln for ln in out.splitlines() if ln.startswith(_MARKER)]
    if code != 0 or not marker:
        raise ZooError(one_line_cause(out, code), failure_excerpt(out))
    return _support_from(json.loads(marker[-1][len(_MARKER):]))


def support_and_reference(path: Path, work_dir: Path, timeout_s: float = SUPPORT_TIMEOUT_S + RUN_TIMEOUT_S,
                          env: Mapping[str, str] | None = None) -> tuple[Support, Trained | ZooError]:
    """``support_of(path)`` and ``reference_losses(path, support, work_dir)`` in one child with a time
    limit (``zoo_lib.py --support FILE --reference WORK_DIR``): the child asks autopar what it offers,
    then runs the one-rank ``autopar run`` in the same process, as ``python -m autopar`` runs it
    (``exit_process(main(argv))``), on the same plan and arguments as ``run_losses``. One process
    start, and one import of torch, autopar and the model's libraries, fewer per model. ZooError
    (raised) if autopar cannot say what it offers; the reference's own failure is returned, as
    ``reference_losses`` returns it. ``env``: the child's environment (default: this process's now;
    a caller in a thread passes one it took beforehand)."""
    support_file = work_dir / f"{path.stem}-support.json"
    support_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--support", str(path), "--reference", str(work_dir)]
    try:
        code, out, _ = _run(cmd, timeout_s, work_dir, env)
    except ZooError as exc:
        if not support_file.exists():  # timed out while asking what autopar offers
            raise
        return _support_from(json.loads(support_file.read_text(encoding="utf-8"))), exc
    lines = out.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith(_MARKER)), None)
    if at is None:
        raise ZooError(one_line_cause(out, code), failure_excerpt(out))
    support = _support_from(json.loads(lines[at][len(_MARKER):]))
    ref_out = "\n".join(lines[at + 1:])  # the reference run's own output
    report = _run_files(path, work_dir, "ref")[1]
    if code != 0 or not report.exists():
        return support, ZooError(f"exit {code}: {_short(one_line_cause(ref_out, code))}", failure_excerpt(ref_out))
    return support, _trained(report)


def _reference_child(path: str, work_dir: str) -> None:
    """(In the child.) ``support_and_reference``'s child: print (and save) what autopar offers, then
    run the one-rank reference in this process; exits with its exit code."""
    d = _support_child(path)
    work = Path(work_dir)
    (work / f"{Path(path).stem}-support.json").write_text(json.dumps(d), encoding="utf-8")
    print(_MARKER + json.dumps(d), flush=True)
    argv, _ = _run_argv(Path(path), _support_from(d), {}, work, "ref")
    from autopar.commands.main import exit_process, main

    sys.argv = [sys.argv[0], *argv]
    exit_process(main(argv))


# ------------------------------------------------------------------------------------------------- plan
def plan_cell(path: Path, work_dir: Path, *, gpus: int = 64, timeout_s: float = PLAN_TIMEOUT_S) -> Cell:
    """``autopar plan FILE --gpus N`` of the full size; ok with its wall seconds, or FAIL with the cause."""
    (work_dir / "full").mkdir(exist_ok=True)
    full = with_size(path, "full", work_dir / "full")
    cmd = [sys.executable, "-m", "autopar", "plan", str(full), "--gpus", str(gpus), "--quiet",
           "-o", str(work_dir / f"{path.stem}-{gpus}gpu.yaml")]
    try:
        code, out, secs = _run(cmd, timeout_s, work_dir)
    except ZooError as exc:
        return Cell(status="FAIL", detail=exc.cause, tail=exc.tail)
    if code != 0:
        return Cell(status="FAIL", detail=f"exit {code}: {_short(one_line_cause(out, code))}", seconds=secs,
                    tail=failure_excerpt(out))
    return Cell(status="ok", detail=f"{secs:.1f} s", seconds=secs)


# -------------------------------------------------------------------------------------------------- run
def plan_for(path: Path, support: Support, parallel: Mapping[str, Any]) -> dict[str, Any]:
    """A plan (YAML v1 mapping, validated by autopar.plan) of the tiny model under ``parallel``."""
    from autopar.plan import plan_from_dict, plan_to_dict

    par = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, **parallel}
    world = par["dp"] * par["tp"] * par["pp"] * par["cp"]
    return plan_to_dict(plan_from_dict({
        "version": 1,
        "model": {"file": str(path), "num_blocks": support.num_blocks},
        "cluster": {"profile": "a100-80g", "num_gpus": world, "gpus_per_node": 8},
        "training": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH,
                     "seq_len": support.seq_len or 1, "dtype": "fp32", "optimizer": "adamw"},
        "parallel": par,
    }))


@dataclass(frozen=True, kw_only=True)
class Trained:
    """What a run cell compares with one rank: every step's loss and each parameter's first-step
    gradient norm (``autopar run --grad-norms``: a wrong gradient the losses of three steps hide)."""

    losses: list[float]
    grad_norms: dict[str, float]


def run_losses(path: Path, support: Support, parallel: Mapping[str, Any], work_dir: Path, tag: str,
               timeout_s: float = RUN_TIMEOUT_S) -> Trained:
    """``autopar run`` of the tiny model under ``parallel`` (one rank: in-process); the per-step
    losses and first-step gradient norms."""
    argv, report = _run_argv(path, support, parallel, work_dir, tag)
    code, out, _ = _run([sys.executable, "-m", "autopar", *argv], timeout_s, work_dir)
    if code != 0 or not report.exists():
        raise ZooError(f"exit {code}: {_short(one_line_cause(out, code))}", failure_excerpt(out))
    return _trained(report)


def _run_files(path: Path, work_dir: Path, tag: str) -> tuple[Path, Path]:
    return work_dir / f"{path.stem}-{tag}.yaml", work_dir / f"{path.stem}-{tag}.json"


def _run_argv(path: Path, support: Support, parallel: Mapping[str, Any], work_dir: Path,
              tag: str) -> tuple[list[str], Path]:
    """Write the plan of ``run_losses``; (the ``autopar`` arguments that run it, the report's path)."""
    import yaml

    plan = plan_for(path, support, parallel)
    world = plan["cluster"]["num_gpus"]
    plan_path, report = _run_files(path, work_dir, tag)
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
    report.unlink(missing_ok=True)
    argv = ["run", str(plan_path), "--steps", str(STEPS), "--report", str(report), "--timeout", "60", "--grad-norms"]
    if world > 1:
        argv += ["--nproc-per-node", str(world)]
    return argv, report


def _trained(report: Path) -> Trained:
    data = json.loads(report.read_text(encoding="utf-8"))
    return Trained(losses=[float(x) for x in data["losses"]],
                   grad_norms={str(k): float(v) for k, v in data.get("grad_norms", {}).items()})


def compare_losses(reference: Sequence[float], got: Sequence[float], rtol: float = RTOL) -> str | None:
    """None when every step's loss matches within ``rtol`` (relative), else what differs."""
    if len(reference) != len(got):
        return f"{len(got)} losses, the reference has {len(reference)}"
    for i, (r, g) in enumerate(zip(reference, got)):
        if not abs(g - r) <= rtol * max(abs(r), 1e-12):
            return f"step {i + 1} loss {g:.6f} vs 1 rank {r:.6f} (rel {abs(g - r) / max(abs(r), 1e-12):.1e})"
    return None


def run_cell(path: Path, support: Support, dim: str, reference: Trained | ZooError, work_dir: Path) -> Cell:
    """One run cell: n/a when autopar does not offer the dimension, else the run compared with 1 rank."""
    for key in RUN_NEEDS[dim]:
        if support.reason(key) is not None:
            return Cell(status="n/a", detail=f"{key}: {_short(support.reason(key), 100)}")
    if isinstance(reference, ZooError):
        return Cell(status="FAIL", detail=f"1-rank reference failed: {reference.cause}", tail=reference.tail)
    parallel = dict(RUNS[dim])
    if dim == "tp2+sp" and support.reason("sp") is not None:
        parallel["sequence_parallel"] = False  # tp is offered without Megatron SP: run tp alone
    start = time.perf_counter()
    try:
        got = run_losses(path, support, parallel, work_dir, dim.replace("+", "-"))
    except ZooError as exc:
        return Cell(status="FAIL", detail=exc.cause, tail=exc.tail)
    except Exception as exc:  # a plan autopar.plan refuses (e.g. num_blocks does not split)
        return Cell(status="FAIL", detail=_short(f"{type(exc).__name__}: {exc}"))
    secs = time.perf_counter() - start
    from autopar.executor.runtime.grad_digest import compare_grad_norms

    diff = compare_losses(reference.losses, got.losses) or compare_grad_norms(reference.grad_norms, got.grad_norms)
    if diff:
        return Cell(status="FAIL", detail=diff, seconds=secs)
    return Cell(status="ok", detail="" if parallel.get("sequence_parallel", True) else "no sp", seconds=secs)


def reference_losses(path: Path, support: Support, work_dir: Path) -> Trained | ZooError:
    """The one-rank run every 2-rank run is compared with (or the error it ended in)."""
    try:
        return run_losses(path, support, {}, work_dir, "ref")
    except ZooError as exc:
        return exc
    except Exception as exc:
        return ZooError(_short(f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True, kw_only=True)
class ModelResult:
    model: ZooModel
    plan: Cell
    support: Support | None
    support_cells: dict[str, Cell]
    runs: dict[str, Cell]

    def cells(self) -> dict[str, Cell]:
        return {"plan64": self.plan, **{f"offer:{k}": c for k, c in self.support_cells.items()},
                **{f"run:{k}": c for k, c in self.runs.items()}}


def evaluate(model: ZooModel, *, dims: Sequence[str] = tuple(RUNS), plan: bool = True, gpus: int = 64) -> ModelResult:
    """Every cell of one model's row (see the module docstring)."""
    missing = model.missing()
    if missing:
        na = Cell(status="n/a", detail=missing)
        return ModelResult(model=model, plan=na, support=None, support_cells={k: na for k in SUPPORT_KEYS},
                           runs={d: na for d in dims})
    with tempfile.TemporaryDirectory(prefix=f"zoo-{model.name}-") as tmp:
        work = Path(tmp)
        plan_c = plan_cell(model.path, work, gpus=gpus) if plan else Cell(status="n/a", detail="--no-plan")
        (work / "tiny").mkdir()
        tiny = with_size(model.path, "tiny", work / "tiny")
        try:
            # what autopar offers, and the one-rank run every run cell is compared with, in one child
            sup, ref = support_and_reference(tiny, work) if dims else (support_of(tiny), Trained(losses=[], grad_norms={}))
        except ZooError as exc:
            fail = Cell(status="FAIL", detail=f"support: {_short(exc.cause)}", tail=exc.tail)
            skipped = Cell(status="n/a", detail="autopar could not say what it supports")
            return ModelResult(model=model, plan=plan_c, support=None, support_cells={k: fail for k in SUPPORT_KEYS},
                               runs={d: skipped for d in dims})
        expected = expected_offers(model.name)
        cells = {k: Cell(status="ok", detail=sup.tp_source if k == "tp" and sup.tp_source else "")
                 if sup.reason(k) is None else
                 Cell(status="n/a", detail=_short(sup.reason(k)), expected=k in expected) for k in SUPPORT_KEYS}
        runs = {d: run_cell(tiny, sup, d, ref, work) for d in dims}
    return ModelResult(model=model, plan=plan_c, support=sup, support_cells=cells, runs=runs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="zoo helper: --support FILE prints what autopar offers (JSON)")
    parser.add_argument("--support", metavar="FILE", required=True)
    parser.add_argument("--reference", metavar="WORK_DIR", help="then run the one-rank reference there")
    args = parser.parse_args()
    if args.reference:
        _reference_child(args.support, args.reference)
    print(_MARKER + json.dumps(_support_child(args.support)), flush=True)
