"""The README is a front door that works: its runnable commands run as pasted, every relative link
in README.md and docs/*.md resolves, and every option of every command is documented.

* A fenced block right after the line ``<!-- runnable -->`` is run in a scratch copy of the
  repository's examples, plans and profiles, with ``autopar`` resolving to ``python -m autopar`` of
  this checkout; nothing in the repository changes. A ``bash`` block runs as one script; in a
  ``console`` block each ``$ `` line is a command and the lines after it are its pasted output:
  the command must exit 0, and every pasted line must appear in what it printed (``...`` elides;
  the search's wall-clock time is ignored).
* Links: ``[text](target)`` outside code blocks; a target in this repository must exist, and a
  ``#fragment`` into a Markdown file must name one of its headings.
* Options: for each command that ``python -m autopar --help`` lists, every ``--option`` its
  ``--help`` shows appears in a section of README.md or docs/*.md whose heading names
  ``autopar <command>``; every option the README documented before it became a front door
  (``OLD_README_OPTIONS``) is still documented somewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RUNNABLE = "<!-- runnable -->"
COPIED = ("examples", "plans", "profiles")  # what the README's commands read, copied to the scratch dir

# Every --option the README named before it became a front door (git show d042420:README.md).
OLD_README_OPTIONS = frozenset("""
--checkpoint-dir --checkpoint-every --cluster --comm --cp --cp-kind --device --dp --dtype --ep
--global-batch --gpus --gpus-per-node --json --load-ranks --loop --master-addr --master-port
--max-restarts --micro-batch --moe-imbalance --nnodes --no-cache --no-comm --no-rank --node-rank
--nproc-per-node --offload --optimizer --plot --pp --profile --quiet --recompute --resume --schedule
--seq-len --slurm --sp --steps --timeout --top --tp --trace --virtual-stages --zero
""".split())

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w-])")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(\s*)```+\s*([\w+-]*)")
WALL_TIME = re.compile(r" in \d+(?:\.\d+)? s\b")


# ------------------------------------------------------------------ Markdown structure
def prose_and_blocks(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, str, bool]]]:
    """(the lines outside fenced blocks with their numbers, the blocks as (lang, body, runnable))."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[str, str, bool]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        before = [ln for _, ln in prose if ln.strip()]
        runnable = bool(before) and before[-1].strip() == RUNNABLE
        body, i = [], i + 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            body.append(lines[i])
            i += 1
        blocks.append((m.group(2), "\n".join(body), runnable))
        i += 1
    return prose, blocks


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, text up to the next heading of the same or a higher level), code blocks included."""
    prose, _ = prose_and_blocks(text)
    heads = [(n, ln) for n, ln in prose if re.match(r"#{1,6} ", ln)]
    lines = text.splitlines()
    out = []
    for k, (n, head) in enumerate(heads):
        level = len(head) - len(head.lstrip("#"))
        end = len(lines)
        for n2, head2 in heads[k + 1:]:
            if len(head2) - len(head2.lstrip("#")) <= level:
                end = n2 - 1
                break
        out.append((head, "\n".join(lines[n - 1:end])))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


# ------------------------------------------------------------------ runnable blocks
def runnable_blocks() -> list[tuple[str, str]]:
    _, blocks = prose_and_blocks(README.read_text())
    return [(lang, body) for lang, body, runnable in blocks if runnable]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A working directory with copies of what the commands read, and an environment whose
    ``autopar`` is this checkout's ``python -m autopar``."""
    work = tmp_path_factory.mktemp("readme")
    for name in COPIED:
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = work / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "autopar"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m autopar "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = dict(os.environ)
    env.pop("AUTOPAR_PROFILES", None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return work, env


def run_bash(script: str, work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)


def console_commands(body: str) -> list[tuple[str, list[str]]]:
    """Each ``$ command`` of a console block with the output lines pasted after it."""
    out: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def test_readme_marks_the_cheap_commands_runnable() -> None:
    blocks = runnable_blocks()
    assert len(blocks) >= 3, "the README should mark its plan, estimate and explain commands runnable"
    text = "\n".join(body for _, body in blocks)
    for verb in ("plan", "estimate", "explain"):
        assert f"autopar {verb} " in text, f"no runnable `autopar {verb}` block in README.md"


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_readme_runnable_block(index: int, scratch: tuple[Path, dict[str, str]]) -> None:
    work, env = scratch
    lang, body = runnable_blocks()[index]
    assert lang in ("bash", "sh", "console"), f"runnable block {index} is `{lang}`: mark bash or console blocks"
    if lang != "console":
        done = run_bash(body, work, env)
        assert done.returncode == 0, f"README block {index} exited {done.returncode}:\n{body}\n{done.stderr[-3000:]}"
        return
    for command, pasted in console_commands(body):
        done = run_bash(command, work, env)
        assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stderr[-3000:]}"
        printed = {WALL_TIME.sub(" in T s", ln.rstrip())
                   for ln in re.split(r"[\r\n]", done.stdout + "\n" + done.stderr)}
        stale = [ln for ln in pasted
                 if ln.strip() not in ("", "...") and WALL_TIME.sub(" in T s", ln.rstrip()) not in printed]
        assert not stale, (f"README.md pastes output `{command}` no longer prints (regenerate it):\n"
                           + "\n".join(stale[:10]))


# ------------------------------------------------------------------ links
@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    prose, _ = prose_and_blocks(page.read_text())
    bad = []
    for n, line in prose:
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                bad.append(f"{page.name}:{n}: {target} (no such file)")
            elif fragment and dest.suffix == ".md":
                anchors = {slug(h) for h, _ in sections(dest.read_text())}
                if fragment not in anchors:
                    bad.append(f"{page.name}:{n}: {target} (no heading #{fragment} in {dest.name})")
    assert not bad, "broken links:\n" + "\n".join(bad)


# ------------------------------------------------------------------ options
def autopar_help(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "autopar", *args, "--help"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def commands() -> list[str]:
    text = autopar_help()
    listing = text.split("positional arguments:", 1)[1].split("options:", 1)[0]
    return re.findall(r"^ {4}([a-z][a-z-]*) ", listing, flags=re.M)


def help_options(command: str) -> set[str]:
    """The long options a command's --help defines (its option lines, not the prose under them)."""
    found = set()
    for line in autopar_help(command).splitlines():
        m = re.match(r"^ {2}(?:-\w(?: \S+)?, )?(--[a-z][a-z0-9-]*)", line)
        if m:
            found.add(m.group(1))
    return found - {"--help"}


def documented_text() -> str:
    return "\n".join(p.read_text() for p in [README, *DOCS])


def command_sections(command: str) -> str:
    """The text of every section of README.md and docs/*.md whose heading names `autopar <command>`."""
    named = re.compile(rf"`autopar {re.escape(command)}(?:[ `])")
    return "\n".join(body for page in [README, *DOCS]
                     for head, body in sections(page.read_text()) if named.search(head))


def test_every_command_option_is_documented_under_its_command() -> None:
    names = commands()
    assert {"plan", "estimate", "run", "explain"} <= set(names), names
    missing = {}
    for name in names:
        text = command_sections(name)
        assert text, f"no section of README.md or docs/*.md has a heading naming `autopar {name}`"
        absent = sorted(o for o in help_options(name) if o not in set(OPTION.findall(text)))
        if absent:
            missing[name] = absent
    assert not missing, f"options in --help but not in their command's docs section: {missing}"


def test_options_the_old_readme_documented_are_still_documented() -> None:
    documented = set(OPTION.findall(documented_text()))
    assert OLD_README_OPTIONS <= documented, sorted(OLD_README_OPTIONS - documented)


def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    setup = re.search(r"```bash\n(# 1\..*?)```", text, flags=re.S)
    assert setup, "the README's set-up block (commands 1 and 2) is missing"
    test_command = [ln for ln in setup.group(1).splitlines() if "pytest" in ln]
    assert test_command and test_command[0].replace("pip install", "python -m pip install") in ci
