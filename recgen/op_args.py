"""Validation of an op's arguments, from metadata only (types, dtypes, shapes): no value is read on the host,
except the NaN/Inf check of the debug mode (``check_finite``). Every error is an ``InputError`` naming the
argument and what was expected."""
from __future__ import annotations

import math
import numbers
import warnings
from functools import lru_cache

from .errors import InputError
from .spec import ir
from .spec.layouts import Sizes, check_state
from .tuning import machine_dialect

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def signature(values) -> tuple | None:
    """Each value's (type, shape, dtype), or None for a None: the whole input of metadata checks, as a cache key.
    None where a value has no shape (not an array: the checks then say what is wrong)."""
    try:
        return tuple(None if x is None else (type(x), x.shape, x.dtype) for x in values)
    except AttributeError:
        return None


class CheckedSignatures:
    """Call signatures whose metadata checks passed, each with what the checks derived, up to ``size`` of them
    (then forgotten at once): a decode loop repeats one signature, and its checks were a third of its host time."""

    def __init__(self, size: int = 64):
        self.size, self.seen = size, {}

    def get(self, key):
        return None if key is None else self.seen.get(key)

    def put(self, key, value) -> None:
        if key is None:
            return
        if len(self.seen) >= self.size:
            self.seen.clear()
        self.seen[key] = value


def check_names(rec: ir.Recurrence, arrays: dict) -> None:
    """Every input given, nothing else (before any argument's type is looked at: a misspelt keyword is
    'unexpected', not 'not an array')."""
    names = [x.name for x in rec.inputs]
    extra = set(arrays) - set(names)
    if extra:
        raise InputError(f"{rec.name}: unexpected argument(s) {sorted(extra)}; inputs are {names}")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise InputError(f"{rec.name}: missing argument(s) {missing}")


@lru_cache(maxsize=1)
def float_mx_dtypes() -> frozenset:
    """``FLOAT_DTYPES`` as MLX dtypes (a set lookup: every op call checks each input's dtype)."""
    import mlx.core as mx

    return frozenset(getattr(mx, name) for name in FLOAT_DTYPES)


def check_array(name: str, a) -> None:
    import mlx.core as mx

    if not isinstance(a, mx.array):
        hint = " (convert it with mx.array)" if hasattr(a, "shape") or isinstance(a, (list, tuple)) else ""
        raise InputError(f"argument {name!r}: expected an mx.array, got {type(a).__name__}{hint}")
    if a.dtype not in float_mx_dtypes():
        raise InputError(f"argument {name!r}: expected float32, float16 or bfloat16, got {a.dtype}")


def state_parts(rec: ir.Recurrence, state, name: str = "initial_state") -> list:
    """The arrays of a state argument (S, or the pair (S, z) with a normalizer), each checked like an input."""
    if rec.has_normalizer:
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise InputError(f"argument {name!r}: {rec.name} has a normalizer, pass the pair (S, z) of mx.arrays, "
                             f"got {type(state).__name__}")
        parts = list(state)
    else:
        parts = [state]
    for p in parts:
        check_array(name, p)
    return parts


def check_initial_state(rec: ir.Recurrence, sizes: Sizes, state) -> list:
    parts = state_parts(rec, state)
    check_state(rec, sizes, state)
    return parts


def check_cu_seqlens(cu_seqlens, sizes: Sizes) -> tuple[int, ...]:
    """FLA's packing: B = 1 and offsets 0 = c_0 <= c_1 <= ... <= c_N = T (empty sequences allowed), given on the
    host (a list, tuple or numpy array of ints): reading an mx.array would wait for the device."""
    if type(cu_seqlens).__module__.startswith("mlx"):
        raise InputError("argument 'cu_seqlens': pass the offsets as a list or numpy array of ints "
                         "(e.g. cu_seqlens.tolist()): reading an mx.array would force evaluation")
    try:
        offsets = tuple(int(c) for c in cu_seqlens)
        exact = all(int(c) == c for c in cu_seqlens)
    except (TypeError, ValueError):
        raise InputError(f"argument 'cu_seqlens': expected a sequence of ints, got {type(cu_seqlens).__name__}") from None
    if not exact or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != sizes.T \
            or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise InputError(f"argument 'cu_seqlens': expected nondecreasing ints from 0 to T={sizes.T}, got {offsets}")
    if sizes.B != 1:
        raise InputError(f"argument 'cu_seqlens': packed sequences need B = 1 (FLA's convention), got B={sizes.B}")
    return offsets


def check_finite(arrays: dict) -> None:
    """Debug mode only: one host sync for every array at once; the culprit is named only on failure.
    ``arrays`` maps an argument name to a list of arrays."""
    import mlx.core as mx

    flat = [(name, a) for name, group in arrays.items() for a in group]
    finite = [mx.all(mx.isfinite(a)) for _, a in flat]
    if bool(mx.all(mx.stack(finite)).item()):
        return
    bad = next(name for (name, _), ok in zip(flat, finite) if not bool(ok.item()))
    raise InputError(f"argument {bad!r}: contains NaN or Inf")


def check_scale(scale) -> float:
    """A finite real number (int, float, numpy scalar). An mx.array is refused: reading it would be a host sync."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        hint = "; pass a Python float (reading an mx.array would force evaluation)" if hasattr(scale, "dtype") else ""
        raise InputError(f"argument 'scale': expected a finite real number or None, got {type(scale).__name__}{hint}")
    value = float(scale)
    if not math.isfinite(value):
        raise InputError(f"argument 'scale': expected a finite real number, got {value}")
    return value


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs: mlx everywhere, plus the GPU dialect MLX has here (if any)."""
    gpu = machine_dialect()
    return ("mlx",) + ((gpu,) if gpu else ())


def check_backend(backend: str, known: tuple[str, ...], source: str = "backend") -> None:
    if backend not in known:
        raise InputError(f"{source}={backend!r}: expected one of {known}")
    here = available_backends()
    if backend not in here:
        raise InputError(f"{source}={backend!r}: not available here (MLX has no {backend} backend on this machine); "
                         f"backends here: {here}")


def warn_head_first(rec: ir.Recurrence, sizes: Sizes) -> None:
    """FLA's heuristic on a spec's op (``warn_layout``), the first per-token input named."""
    warn_layout(rec.name, next(x.name for x in rec.inputs if x.per_token), sizes.T, sizes.H, stacklevel=4)


def warn_layout(op: str, first: str, T: int, H: int, stacklevel: int = 3) -> None:
    """FLA's heuristic: inputs are [B,T,H,...]; T < H suggests head-first [B,H,T,...] was passed. Decoding
    (T = 1) is exempt, as it is always 'T < H'. ``stacklevel`` points the warning at the user's call."""
    if 1 < T < H:
        warnings.warn(f"{op}: input shapes suggest a layout mismatch: T={T} < H={H} (axis 1 of {first!r} is T). "
                      "Inputs are [B,T,H,...] (FLA's layout); head-first [B,H,T,...] inputs must be transposed "
                      "(axes 1 and 2)", UserWarning, stacklevel=stacklevel)


def _shape(name: str, a, expected: str, ok: bool) -> None:
    if not ok:
        raise InputError(f"argument {name!r}: expected {expected}, got shape {tuple(a.shape)}")


def check_mamba2(x, dt, A, B, C, D, z, dt_bias, initial_states, dt_limit, unsupported: dict) -> tuple:
    """mamba_ssm's ``mamba_chunk_scan_combined`` arguments, from metadata only: x [B,T,H,P], dt [B,T,H], A [H],
    B, C [B,T,G,N] with G dividing H, D [H] or [H,P], z [B,T,H,P], dt_bias [H], initial_states [B,H,P,N];
    ``dt_limit`` a pair lo <= hi. ``unsupported``: name -> value of arguments recgen does not take (each must be
    None or False). Returns (dt_lo, dt_hi)."""
    for name, value in unsupported.items():
        if value is not None and value is not False:
            raise InputError(f"argument {name!r}: not supported by recgen's mamba2 (pass None); "
                             + UNSUPPORTED_MAMBA2.get(name, ""))
    named = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)
    for name, a in named.items():
        if a is not None:
            check_array(name, a)
    _shape("x", x, "[B,T,H,P]", x.ndim == 4)
    b, t, H, P = x.shape
    _shape("dt", dt, f"[B,T,H] = {[b, t, H]}", tuple(dt.shape) == (b, t, H))
    _shape("A", A, f"[H] = [{H}]", tuple(A.shape) == (H,))
    _shape("B", B, f"[B,T,G,N] with B={b}, T={t} and G dividing H={H}",
           B.ndim == 4 and tuple(B.shape[:2]) == (b, t) and B.shape[2] > 0 and H % B.shape[2] == 0)
    N = B.shape[3]
    _shape("C", C, f"the shape of B [B,T,G,N] = {list(B.shape)}", tuple(C.shape) == tuple(B.shape))
    if D is not None:
        _shape("D", D, f"[H] = [{H}] or [H,P] = {[H, P]}", tuple(D.shape) in ((H,), (H, P)))
    if z is not None:
        _shape("z", z, f"the shape of x [B,T,H,P] = {list(x.shape)}", tuple(z.shape) == tuple(x.shape))
    if dt_bias is not None:
        _shape("dt_bias", dt_bias, f"[H] = [{H}]", tuple(dt_bias.shape) == (H,))
    if initial_states is not None:
        _shape("initial_states", initial_states, f"[B,H,P,N] = {[b, H, P, N]}",
               tuple(initial_states.shape) == (b, H, P, N))
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise InputError(f"argument 'dt_limit': expected a pair of floats (lo, hi), got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise InputError(f"argument 'dt_limit': expected lo <= hi, got {dt_limit!r}")
    return lo, hi


UNSUPPORTED_MAMBA2 = {
    "seq_idx": "run each sequence as its own call, or pack them with recgen.load('mamba2')(..., cu_seqlens=...)",
    "cu_seqlens": "mamba's cu_seqlens only serves return_varlen_states; pack sequences with "
                  "recgen.load('mamba2')(..., cu_seqlens=...)",
    "return_varlen_states": "run each sequence as its own call with return_final_states=True",
    "state_dtype": "the state is float32",
}


def check_delta_product(q, k, v, g, beta, num_householder, initial_state, cu_seqlens) -> tuple | None:
    """FLA's ``chunk_gated_delta_product`` arguments, from metadata only: q [B,T,Hk,K]; k [B,T*n,Hk,K];
    v [B,T*n,H,V] with Hk dividing H; beta [B,T*n,H]; g None or [B,T,H]; n = ``num_householder`` a positive int;
    initial_state [N,H,K,V] (N = B, or the number of packed sequences). Returns cu_seqlens' offsets (None
    without)."""
    n = num_householder
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        hint = " (reading an mx.array would force evaluation)" if hasattr(n, "dtype") else ""
        raise InputError(f"argument 'num_householder': expected a positive int, got {n!r}{hint}")
    n = int(n)
    named = dict(q=q, k=k, v=v, g=g, beta=beta)
    for name, a in named.items():
        if a is not None or name != "g":
            check_array(name, a)
    _shape("q", q, "[B,T,Hk,K]", q.ndim == 4 and q.shape[2] > 0)
    B, T, Hk, K = q.shape
    Tn = T * n
    _shape("k", k, f"[B,T*n,Hk,K] = {[B, Tn, Hk, K]} (T*n: num_householder={n} rows a token)",
           tuple(k.shape) == (B, Tn, Hk, K))
    _shape("v", v, f"[B,T*n,H,V] with B={B}, T*n={Tn} (num_householder={n}) and H a multiple of Hk={Hk}",
           v.ndim == 4 and tuple(v.shape[:2]) == (B, Tn) and v.shape[2] > 0 and v.shape[2] % Hk == 0)
    H, V = v.shape[2], v.shape[3]
    _shape("beta", beta, f"[B,T*n,H] = {[B, Tn, H]} (num_householder={n})", tuple(beta.shape) == (B, Tn, H))
    if g is not None:
        _shape("g", g, f"[B,T,H] = {[B, T, H]} (one gate a token) or None", tuple(g.shape) == (B, T, H))
    sizes = Sizes(B, T, H, Hk, K, K, V)
    offsets = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, sizes)
    if offsets is None:  # FLA's heuristic on the tokens (not the T·n micro-steps)
        warn_layout("gated_delta_product", "q", T, H, stacklevel=4)
    if initial_state is not None:
        check_array("initial_state", initial_state)
        N = B if offsets is None else len(offsets) - 1
        _shape("initial_state", initial_state, f"[N,H,K,V] = {[N, H, K, V]}",
               tuple(initial_state.shape) == (N, H, K, V))
    return offsets
