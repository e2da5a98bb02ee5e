"""Kendall's tau of the cost model's order of published configurations (autopar.reference_rank)."""

from __future__ import annotations

import pytest

from autopar.reference_rank import RankedSource, kendall_tau, ranked_sources


def test_kendall_tau_counts_pairs():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([3, 2, 1], [10, 20, 30]) == -1.0
    assert kendall_tau([1, 3, 2], [10, 20, 30]) == pytest.approx(1 / 3)  # one of three pairs swapped
    assert kendall_tau([1, 1, 2], [10, 20, 30]) == pytest.approx(2 / 3)  # a predicted tie counts as neither
    with pytest.raises(ValueError):
        kendall_tau([1.0], [1.0])


def test_a_source_reports_its_pairs_in_order():
    src = RankedSource(source="s", quantity="ms", names=("a", "b", "c"), published=(1.0, 2.0, 3.0),
                       predicted=(1.5, 1.0, 3.5))
    assert src.pairs == (2, 3) and src.tau == pytest.approx(1 / 3)


def test_every_multi_configuration_source_is_ordered_as_it_ran():
    sources = {s.source: s for s in ranked_sources()}
    table4 = next(s for name, s in sources.items() if name.startswith("Korthikanti"))
    assert len(table4.names) == 5 and table4.tau >= 0.8  # the target on a 3+ configuration source
    assert all(s.tau == 1.0 for s in sources.values()), {n: s.tau for n, s in sources.items()}
