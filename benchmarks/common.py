"""Shared by the benchmark scripts: the one error metric of recgen's checks."""
from recgen.testing import rel_err  # noqa: F401
