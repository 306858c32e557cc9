"""``--shard K/N`` (tests/sharding.py), which benchmarks/run_gpu.sh uses to run the GPU suite as parallel
processes: the parts are disjoint, cover every group, keep groups whole and are balanced."""
from __future__ import annotations

import pytest
from sharding import parse_shard, assign


def test_parts_cover_every_group_once_and_balance():
    groups = {f"g{i}": size for i, size in enumerate([14, 14, 13, 13, 10, 9, 5, 4, 3, 1, 1, 1])}
    part = assign(groups, 4)
    assert set(part) == set(groups) and set(part.values()) == {0, 1, 2, 3}
    load = [sum(s for g, s in groups.items() if part[g] == k) for k in range(4)]
    assert sum(load) == sum(groups.values())
    assert max(load) - min(load) <= max(groups.values())  # largest first, to the least loaded part
    assert assign(dict(reversed(list(groups.items()))), 4) == part  # the same in every process


def test_more_parts_than_groups_leaves_parts_empty():
    assert sorted(assign({"a": 3, "b": 1}, 4).values()) == [0, 1]


@pytest.mark.parametrize("text", ["1", "a/b", "2/2", "-1/3", "0/0"])
def test_bad_shard_is_a_usage_error(text):
    with pytest.raises(pytest.UsageError, match="--shard"):
        parse_shard(text)


def test_shard_parses():
    assert parse_shard("3/8") == (3, 8)
