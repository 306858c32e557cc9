"""A function's MLX graph recorded once per signature and replayed, instead of built again by its Python.

Under ``mx.vjp`` MLX compiles nothing: every array a transformation touches is a tracer, and ``mx.compile`` falls back
to calling the function. So an eager training step runs every chunk core's Python (its kernel calls, role math,
reshapes) again each call, and the GPU waits for it: about 1 ms of a 5 ms step on the H100's host. MLX's exported
functions are the way around it: ``mx.import_function`` rebuilds the recorded graph node by node in C++ (no tracer
check), on whatever arrays it is given, tracers included; a caller's ``mx.compile`` traces through the rebuilt nodes
and fuses them as it would the Python's.

A ``Replay`` records with ``mx.export_function`` (into a directory of this process, removed at exit) the first time
it sees an input signature (shapes and dtypes), then replays. What it records must be a plain graph: no
``mx.custom_function`` inside (MLX cannot serialize one), outputs a tuple or list of arrays, nothing read from the
host. The function is a pure function of its arrays' values at one signature: its Python choices (tuning, shapes)
are made while recording and kept. Where recording fails (a primitive MLX cannot serialize), the function runs as
Python, as before, with one warning.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import warnings

_directory: str | None = None
_lock = threading.Lock()
_names = itertools.count()


def _records_dir() -> str:
    global _directory
    with _lock:
        if _directory is None:
            _directory = tempfile.mkdtemp(prefix="recgen-graphs-")
            atexit.register(shutil.rmtree, _directory, True)
        return _directory


def signature(arrays) -> tuple:
    """The shapes and dtypes of ``arrays``: what one recorded graph is specific to."""
    return tuple((tuple(a.shape), a.dtype) for a in arrays)


class Replay:
    """``fn(*arrays) -> tuple of arrays``, recorded per input signature and replayed; ``active()`` (called each
    time) says whether to replay now, else ``fn`` runs as Python (a recording of kernel calls, a debug mode)."""

    def __init__(self, fn, name: str, active=lambda: True):
        self.fn, self.name, self.active = fn, name, active
        self.graphs: dict = {}  # signature -> the imported function, or None where recording failed

    def __call__(self, *arrays):
        if not self.active():
            return tuple(self.fn(*arrays))
        key = signature(arrays)
        graph = self.graphs.get(key, False)
        if graph is False:
            graph = self.graphs[key] = self._record(arrays)
        return tuple(self.fn(*arrays) if graph is None else graph(*arrays))

    def _record(self, arrays):
        import mlx.core as mx

        path = os.path.join(_records_dir(), f"{self.name}_{next(_names)}.mlxfn")
        try:
            mx.export_function(path, self.fn, *arrays)
            return mx.import_function(path)
        except (ValueError, RuntimeError) as e:
            warnings.warn(f"recgen: {self.name} runs as Python each call (its graph could not be recorded: {e})",
                          RuntimeWarning, stacklevel=3)
            return None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)  # the imported function holds the graph; the file is not read again
