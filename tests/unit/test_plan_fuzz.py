"""Issue 6: fuzz the plan loader (``autopar.plan.parse_plan``) with random and mutated YAML.

Properties: the loader returns a Plan or raises PlanError with a one-line message -- never another
exception -- and no ``!!python/...`` tag ever runs code (a sentinel file must not appear).
CI runs a few hundred examples per property; ``benchmarks/fuzz_plans.py`` runs the same strategies
for >= 5,000 examples.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.plan import Plan, parse_plan

VALID: dict[str, Any] = {
    "version": 1,
    "model": {"file": "examples/gpt.py", "num_blocks": 8, "sha256": "a" * 64},
    "cluster": {"profile": "a100-80g", "num_gpus": 16, "gpus_per_node": 8},
    "training": {"global_batch_size": 32, "micro_batch_size": 2, "seq_len": 2048, "dtype": "bf16", "optimizer": "adam"},
    "parallel": {"dp": 2, "tp": 4, "pp": 2, "cp": 1, "cp_kind": "ring", "sequence_parallel": True, "zero": 1,
                 "recompute": "selective", "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2,
                 "stages": [[0, 2], [2, 4], [4, 6], [6, 8]]},
    "prediction": {"step_time_s": 1.5},
}
SENTINEL = Path(os.environ.get("TMPDIR", "/tmp")) / f"autopar-fuzz-pwned-{os.getpid()}"
PAYLOADS = [
    f"!!python/object/apply:os.system ['touch {SENTINEL}']",
    f"!!python/object/apply:subprocess.call [['touch', '{SENTINEL}']]",
    f"!!python/object/new:subprocess.Popen [['touch', '{SENTINEL}']]",
    "!!python/name:os.system",
    "!!python/module:os",
    f"!!python/object/apply:builtins.exec [\"open('{SENTINEL}', 'w')\"]",
    "!!binary aGVsbG8=",
    "!!set {a, b}",
    "&a [*a]",
]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["ring", "1f1b", "bf16", "adam", "none", "full", "gpipe", "-1", "0", "1e9", "~", "yes", "NaN"]),
)
yaml_values = st.recursive(
    scalars, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=12), kids, max_size=4)),
    max_leaves=12,
)
KEYS = [(None, k) for k in VALID] + [(s, k) for s, body in VALID.items() if isinstance(body, dict) for k in body]


@st.composite
def mutated_plans(draw) -> dict:
    """A valid plan with 1-4 mutations: drop, retype, add, or replace a key or a whole section."""
    data = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 4))):
        section, key = draw(st.sampled_from(KEYS))
        target = data if section is None else data.get(section)
        if not isinstance(target, dict):
            continue
        op = draw(st.sampled_from(["drop", "value", "add", "small-int"]))
        if op == "drop":
            target.pop(key, None)
        elif op == "value":
            target[key] = draw(yaml_values)
        elif op == "add":
            target[draw(st.text(min_size=1, max_size=10))] = draw(yaml_values)
        else:
            target[key] = draw(st.integers(-3, 20))
    return data


@st.composite
def mutated_text(draw) -> str:
    """Character-level edits of a valid plan's YAML text (broken indentation, quotes, flow syntax)."""
    text = yaml.safe_dump(VALID, sort_keys=False)
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(st.one_of(st.text(max_size=6), st.sampled_from(["\n", ": ", "- ", "{", "[", "'", '"', "&x ", "*x", "!!", "\t", "  "])))
        if op == "insert":
            text = text[:i] + piece + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 8)):]
        else:
            text = text[:i] + piece + text[i + len(piece):]
    return text


def check_loader(text: str) -> str:
    """The property: a Plan, or a one-line PlanError. Returns 'ok' or 'error' (for the benchmark)."""
    try:
        plan = parse_plan(text, source="fuzz.yaml")
    except PlanError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, repr(msg)
        return "error"
    assert isinstance(plan, Plan)
    return "ok"


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_valid_plan_loads() -> None:
    assert check_loader(_dump(VALID)) == "ok"


@FUZZ
@given(mutated_plans())
def test_mutated_plans_never_crash(data: dict) -> None:
    check_loader(_dump(data))


@FUZZ
@given(mutated_text())
def test_mutated_text_never_crashes(text: str) -> None:
    check_loader(text)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=200), yaml_values.map(_dump)))
def test_random_documents_never_crash(text: str) -> None:
    check_loader(text)


@st.composite
def tagged_text(draw) -> tuple[str, str]:
    """(payload, document): the payload as the whole document or as one value of a valid plan."""
    payload = draw(st.sampled_from(PAYLOADS))
    if draw(st.booleans()):
        return payload, payload + "\n"
    section, key = draw(st.sampled_from(KEYS))
    data = copy.deepcopy(VALID)
    (data if section is None else data[section])[key] = "PAYLOAD"
    return payload, _dump(data).replace("PAYLOAD", payload)


@settings(max_examples=200, deadline=None)
@given(tagged_text())
def test_python_tags_never_execute(case: tuple[str, str]) -> None:
    """A code-execution tag anywhere (whole document, or as one value) is refused and runs nothing."""
    payload, text = case
    result = check_loader(text)
    assert not SENTINEL.exists(), "a python tag executed code"
    if "python/" in payload:
        assert result == "error"


@pytest.mark.parametrize("payload", PAYLOADS[:6])
def test_python_tag_message_names_the_tag(payload: str) -> None:
    with pytest.raises(PlanError) as exc:
        parse_plan(payload + "\n", source="evil.yaml")
    assert "evil.yaml" in str(exc.value) and "python/" in str(exc.value)
    assert not SENTINEL.exists()
