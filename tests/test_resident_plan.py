"""offload.swap.resident.resident_plan: which stage-3 partitions stay in host memory under max_in_cpu."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from offload.swap.resident import resident_plan

sizes = st.lists(st.integers(min_value=1, max_value=10_000), max_size=60)


@settings(max_examples=300, deadline=None)
@example(numels=[], budget=-5)
@given(numels=sizes, budget=st.integers(min_value=-10, max_value=300_000))
def test_plan_properties(numels, budget):
    plan = resident_plan(numels, budget)
    assert len(plan) == len(numels)
    kept = sum(n for n, r in zip(numels, plan) if r)
    if sum(numels) <= budget:
        assert all(plan)
        return
    if budget <= 0:
        assert not any(plan)
        return
    assert kept <= budget
    assert plan[0] == (numels[0] <= budget)
    # no streamed partition fits what is left of the budget (as with first fit)
    assert all(kept + n > budget for n, r in zip(numels, plan) if not r)


def test_equal_partitions_are_spread_along_the_order():
    """A fifth of 100 equal partitions: the first, then one in about every five - not the first twenty."""
    plan = resident_plan([10] * 100, 200)
    kept = [i for i, r in enumerate(plan) if r]
    assert len(kept) == 20 and kept[0] == 0
    assert max(b - a for a, b in zip(kept, kept[1:])) <= 6
    assert kept[-1] >= 90


def test_a_large_first_partition_still_leaves_the_rest_spread():
    """An embedding-like first partition takes its share, the rest of the budget spreads over the layers."""
    numels = [500] + [100] * 50
    plan = resident_plan(numels, 1500)
    assert plan[0]
    kept = [i for i, r in enumerate(plan) if r]
    assert sum(numels[i] for i in kept) == 1500
    assert kept[1] > 1 and kept[-1] > 40


def test_first_partition_too_large_for_the_budget_is_streamed():
    assert resident_plan([1000, 10, 10, 10], 25) == [False, True, True, False]
