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
    # Every pair in its published order, but for a pair priced within 0.1 % (a tie at the model's
    # resolution): dgxc's Llama 3.1 8B at 8 and 128 GPUs ran 12.91 and 13.10 s, and the model prices
    # the two within 2 ms of 13.96 s -- what makes 16 nodes 1.5 % slower than one (not the data-
    # parallel collectives, priced at 28 ms) is not in it (docs/results.md, "Megatron's optimizer step").
    def misordered(s: RankedSource) -> list[tuple[str, str]]:
        out = []
        for i in range(len(s.names)):
            for j in range(i + 1, len(s.names)):
                same = (s.predicted[i] - s.predicted[j]) * (s.published[i] - s.published[j]) > 0
                tie = abs(s.predicted[i] / s.predicted[j] - 1) < 1e-3
                if not same and not tie:
                    out.append((s.names[i], s.names[j]))
        return out

    assert not any(misordered(s) for s in sources.values()), {n: misordered(s) for n, s in sources.items()}
