"""Caches keyed on a call's values stay bounded: with chunk kernels the readout's constant (``rfac``, a value of the
scale) is part of the chunked core's key, so a model sweeping scales must not hold every core it ever built."""
from recgen import tuning
from recgen.chunked import parallel


def test_chunked_core_cache_is_bounded():
    limit = parallel.core_fn.cache_info().maxsize
    assert limit is not None
    t = tuning.resolve("cpu", environ={})
    for i in range(limit + 20):
        parallel.core_fn(False, False, True, t, rfac=0.1 + 0.01 * i)
    assert parallel.core_fn.cache_info().currsize <= limit
