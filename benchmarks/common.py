"""The error metric of the GPU check: like recgen.testing.rel, but a non-finite output scores inf
instead of raising, so one bad case is reported beside the others."""
from __future__ import annotations

import numpy as np


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
