"""``--shard K/N``: run the K-th (0-based) of N disjoint parts of the selected tests, so that N processes run the
GPU suite in parallel (``benchmarks/run_gpu.sh check``): there most of the time is kernel compilation, which
is single-threaded per process. Tests of one ``xdist_group`` (those that share compiled kernels) stay in one
part; the groups are dealt largest first to the part with the fewest tests, the same way in every process."""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only part K (0-based) of N of the selected tests, xdist groups kept whole")


def parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {text!r}: expected K/N with integers, e.g. 0/8") from None
    if not (n >= 1 and 0 <= k < n):
        raise pytest.UsageError(f"--shard {text!r}: expected 0 <= K < N")
    return k, n


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return item.nodeid
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def assign(groups: dict[str, int], n: int) -> dict[str, int]:
    """group -> part: largest group first (ties by name), each to the part with the fewest tests so far."""
    load, part = [0] * n, {}
    for g in sorted(groups, key=lambda g: (-groups[g], g)):
        part[g] = min(range(n), key=lambda i: (load[i], i))
        load[part[g]] += groups[g]
    return part


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: only the selected tests are dealt
def pytest_collection_modifyitems(config, items):
    text = config.getoption("--shard")
    if not text:
        return
    k, n = parse_shard(text)
    sizes: dict[str, int] = {}
    for item in items:
        sizes[_group(item)] = sizes.get(_group(item), 0) + 1
    part = assign(sizes, n)
    keep = [item for item in items if part[_group(item)] == k]
    config.hook.pytest_deselected(items=[item for item in items if part[_group(item)] != k])
    items[:] = keep
