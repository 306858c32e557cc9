"""The chunk kernels' self-test (``recgen.chunked.kernels.usable``) passes on this GPU for every frame: where
one fails, the chunked form silently falls back to MLX ops ("base", "scan") or to the FMA scan ("mma"), so
the checks of the chunked form would pass without testing the kernels."""
from __future__ import annotations

import warnings

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("probe")]


@pytest.mark.parametrize("frame", ["base", "scan", "mma"])
def test_chunk_kernels_pass_their_self_test(frame):
    from recgen.chunked.kernels import usable

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = usable("cuda", frame)
    assert ok, f"the {frame!r} frame failed its self-test: {[str(w.message) for w in caught]}"
