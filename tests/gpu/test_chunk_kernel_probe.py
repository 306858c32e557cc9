"""The chunk kernels' self-test (``recgen.runtime.probe.usable``) passes on this GPU for every frame: where
one fails, the chunked form silently falls back to MLX ops ("base", "scan"; "tail": the backward's) or to the FMA
scan ("mma"), so the checks of the chunked form would pass without testing the kernels."""
from __future__ import annotations

import warnings

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("probe")]


@pytest.mark.parametrize("frame", ["base", "sympow", "tail", "scan", "mma", "pairs", "decode", "features", "ut16", "s16",
                                   "keyfactor", "rows", "hoist", "hoist_e", "async", "scores",
                                   "mix", "factors"])
def test_chunk_kernels_pass_their_self_test(frame):
    from recgen.runtime.probe import usable

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = usable("cuda", frame)
    assert ok, f"the {frame!r} frame failed its self-test: {[str(w.message) for w in caught]}"


def test_the_dispatchers_tuning_keeps_the_measured_kernels():
    """On the H100 the checked tuning keeps CUDA's measured table: chunk kernels on, the scan on fragments
    (MLX_ENABLE_TF32=0 in this suite turns the fragments off by intention, so it is asked for explicitly)."""
    from recgen import tuning
    from recgen.runtime.probe import checked

    with tuning.override(mma_scan=True):
        t = checked(tuning.current())
    assert (t.device, t.dialect, t.chunk_kernels, t.mma_scan) == ("gpu", "cuda", True, True)
