"""`balanced_owners`: how the ranks of one data prep split the capture's shards."""

from __future__ import annotations

import random

from data_prep.conversations.ranks import balanced_owners


def loads(costs: list[int], owners: list[int], world: int) -> list[int]:
    return [sum(c for c, r in zip(costs, owners) if r == rank) for rank in range(world)]


def test_length_sorted_shards_split_evenly_where_by_index_they_would_not():
    costs = [100, 200, 300, 400, 500, 600, 700, 800]  # shards are length-sorted: the last longest
    owners = balanced_owners(costs, 2)
    assert loads(costs, owners, 2) == [1800, 1800]
    by_index = loads(costs, [i % 2 for i in range(len(costs))], 2)
    assert max(by_index) - min(by_index) == 400


def test_every_job_has_one_owner_within_four_thirds_of_the_best_split():
    rng = random.Random(0)
    for world in (1, 2, 3, 8):
        costs = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 30))]
        owners = balanced_owners(costs, world)
        assert len(owners) == len(costs) and set(owners) <= set(range(world))
        best = max(max(costs), sum(costs) / world)  # no split does better than this
        assert max(loads(costs, owners, world)) <= 4 / 3 * best + max(costs) / 3


def test_the_same_costs_give_the_same_owners_and_ties_go_to_the_lower_rank():
    assert balanced_owners([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    assert balanced_owners([], 2) == []
    assert balanced_owners([3, 1, 2], 1) == [0, 0, 0]
