"""``autopar export PLAN.yaml --to megatron|torchtitan|deepspeed|accelerate [-o FILE]``: the plan in
the engine's own configuration format (Megatron-LM flags, a torchtitan TOML, a DeepSpeed JSON, an
accelerate config YAML). A plan feature the engine cannot express is an error naming the feature and
the command that plans for that engine -- never a silently different configuration.
``autopar estimate MODEL.py --from ENGINE FILE`` reads the file back (docs/engines.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar.engines.capability import EXPORT_ENGINES
from autopar.errors import AutoparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.yaml", help="plan file (YAML v1), e.g. from 'autopar plan --engine ENGINE'")
    p.add_argument("--to", required=True, choices=EXPORT_ENGINES, metavar="|".join(EXPORT_ENGINES),
                   help="the engine: megatron (Megatron-LM / NeMo flags), torchtitan (TOML, and torchtitan 0.3's "
                        "command-line overrides in its header), deepspeed (config JSON), accelerate (config YAML)")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write it (default: print to stdout)")
    p.add_argument("--check", action="store_true",
                   help="before writing, load the export with the engine's own code (megatron-core's "
                        "TransformerConfig, torchtitan's config classes, DeepSpeedConfig, accelerate's config loader; "
                        "the engine must be installed) and compare the degrees and batch it reads with the plan's")


def main(args: argparse.Namespace) -> int:
    from autopar.api import as_plan, cluster_for
    from autopar.engines import export_config
    from autopar.outputs import check_output_file, write_text_atomic

    plan = as_plan(args.plan)
    if args.output:
        check_output_file(args.output, "-o")
    cluster = cluster_for(plan) if args.to == "megatron" else None  # its software flags (overlaps)
    text = export_config(plan, args.to, plan_name=Path(args.plan).name, cluster=cluster)
    if args.check:
        from autopar.engines.check import PACKAGES, check_export

        checked = check_export(plan, args.to, text)
        if checked is None:
            raise AutoparError(f"--check needs {PACKAGES[args.to]} installed (pip install {PACKAGES[args.to]}); "
                               f"or export without --check")
        print(f"{args.to}: {checked}", file=sys.stderr)
    if not args.output:
        sys.stdout.write(text)
        return 0
    write_text_atomic(args.output, text, "-o")
    print(f"{args.to} configuration written to {args.output}", file=sys.stderr)
    return 0
