"""Graphs recorded once and replayed (``recgen.runtime.replay``, ``recgen.runtime.pieces``): the replay gives the same
arrays as the function's Python, under ``mx.vjp`` too (where MLX compiles nothing), runs the Python only while
recording, falls back to it with a warning where MLX cannot record; a body of pieces and glue as one recorded forward
and VJP matches autodiff, and every chunked form so recorded gives its Python's outputs and gradients."""
import warnings

import mlx.core as mx
import numpy as np
import pytest

from recgen import chunked, specs, tuning
from recgen.runtime import chunk_kernels as ck
from recgen.runtime.pieces import Piece, whole
from recgen.runtime.replay import Replay
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs


def _counting(fn):
    calls = []

    def counted(*a):
        calls.append(1)
        return fn(*a)
    return counted, calls


def _body(x, y):
    return mx.exp(x) * y, (x @ y.T).sum(-1)


def _body_vjp(x, y, c0, c1):
    e = mx.exp(x)
    return c0 * e * y + c1[:, None] * y.sum(0), c0 * e + (c1[:, None] * x).sum(0)


def test_replay_records_once_and_gives_the_functions_arrays(rng):
    fn, calls = _counting(_body)
    r = Replay(fn, "body")
    x, y = (mx.array(rng.standard_normal((3, 5)), dtype=mx.float32) for _ in range(2))
    want = _body(x, y)
    for _ in range(3):
        got = r(x, y)
        assert isinstance(got, tuple) and len(got) == 2
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    assert len(calls) == 1  # traced once, when recorded
    r(mx.ones((4, 5)), mx.ones((4, 5)))  # a new signature is recorded on its own
    assert len(calls) == 2 and len(r.graphs) == 2


def test_a_replayed_custom_vjp_matches_autodiff_under_vjp_and_compile(rng):
    fwd, bwd = Replay(_body, "body"), Replay(_body_vjp, "body_vjp")

    @mx.custom_function
    def f(x, y):
        return fwd(x, y)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
        return bwd(*primals, *cots)

    def loss(op):
        return lambda x, y: (op(x, y)[0] ** 2).sum() + (op(x, y)[1] ** 3).sum()

    x, y = (mx.array(rng.standard_normal((4, 6)), dtype=mx.float32) for _ in range(2))
    want = mx.grad(loss(_body), argnums=(0, 1))(x, y)
    for grad in (mx.grad(loss(f), argnums=(0, 1)), mx.compile(mx.grad(loss(f), argnums=(0, 1)))):
        for _ in range(2):
            for a, b in zip(grad(x, y), want):
                np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


def test_inactive_replay_runs_the_python_each_call(rng):
    fn, calls = _counting(_body)
    r = Replay(fn, "body", active=lambda: False)
    x = mx.array(rng.standard_normal((2, 3)), dtype=mx.float32)
    for _ in range(3):
        r(x, x)
    assert len(calls) == 3 and not r.graphs


def test_what_mlx_cannot_record_runs_as_python_with_a_warning(rng):
    fn, calls = _counting(lambda x: (mx.contiguous(x.T) * 2,))  # MLX serializes no Contiguous
    r = Replay(fn, "transposed")
    x = mx.array(rng.standard_normal((3, 4)), dtype=mx.float32)
    with pytest.warns(RuntimeWarning, match="transposed runs as Python each call.*Contiguous"):
        got = r(x)
    got = r(x)
    np.testing.assert_array_equal(np.array(got[0]), 2 * np.array(x).T)
    assert list(r.graphs.values()) == [None] and len(calls) == 3  # the failed trace, then each call


@pytest.mark.parametrize("ml", [None, (4, 2, 3, True), (4, 2, 3, False)])
def test_model_layout_copies_are_recorded(ml, rng):
    """``chunk_kernels.model_chunks`` (the backward's copies of simple GLA's q, k, v to the chunks' layout, GQA's key
    heads expanded by block or tile) is recorded without falling back (a fallback warns, which fails here), and gives
    the layout numpy gives."""
    H = 4 if ml is None else ml[1]
    x = mx.array(rng.standard_normal((2, 24, H, 5)), dtype=mx.float32)
    r = Replay(lambda a: (ck.model_chunks(a, 3, ml),), "chunks")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = [np.array(r(x)[0]) for _ in range(2)]
    assert list(r.graphs.values())[0] is not None
    xs = np.array(x)
    if ml is not None:
        xs = np.repeat(xs, 2, axis=2) if ml[3] else np.tile(xs, (1, 1, 2, 1))
    want = xs.reshape(2, 3, 8, 4, 5).transpose(0, 3, 1, 2, 4)
    for g in got:
        np.testing.assert_array_equal(g, want)


def _square_piece():
    """x -> (x², 2x) with a written VJP, as a chunk core is."""
    return Piece(lambda x: (x * x, 2 * x), lambda args, outs, cots: (2 * args[0] * cots[0] + 2 * cots[1],))


@pytest.mark.parametrize("arity", ["one in, three out", "two in, one out"])
def test_replayed_pieces_of_either_arity_match_autodiff(arity, rng):
    """A piece of one argument and several outputs (the decay factors') and one of two arguments and one output (the
    decayed scores'): MLX hands a lone array to a custom VJP as itself, not in a tuple."""
    wrap = lambda f, name: Replay(f, name)  # noqa: E731
    if arity == "one in, three out":
        plain = lambda l: (mx.exp(l), 2 * l, l.sum(-1))  # noqa: E731
        vjp = lambda a, o, c: (c[0] * o[0] + 2 * c[1] + c[2][:, None],)  # noqa: E731
        args = [mx.array(rng.standard_normal((3, 4)), dtype=mx.float32)]
    else:
        plain = lambda P, l: (P * l[:, None] ** 2,)  # noqa: E731
        vjp = lambda a, o, c: (c[0] * a[1][:, None] ** 2, (c[0] * a[0]).sum(-1) * 2 * a[1])  # noqa: E731
        args = [mx.array(rng.standard_normal(s), dtype=mx.float32) for s in ((3, 4), (3,))]
    piece = Piece(plain, vjp, wrap, "p")

    def loss(f):
        return lambda *a: sum((o * o).sum() for o in f(*a))

    want = mx.grad(loss(plain), argnums=tuple(range(len(args))))(*args)
    for _ in range(2):
        got = mx.grad(loss(piece), argnums=tuple(range(len(args))))(*args)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)


def test_a_whole_body_of_pieces_and_glue_matches_autodiff(rng):
    """Glue, a piece, glue reading the piece's outputs and an input, a second piece on the glue's result, and an
    input nothing reads: its gradient is zero; the others MLX's autodiff of the same math."""
    sq, sq2 = _square_piece(), _square_piece()

    def body(a, b, unused):
        s, d = sq(mx.sin(a) * b)
        t, _ = sq2(s + d * b)
        return t.sum(-1), s * 3

    def plain(a, b, unused):
        x = mx.sin(a) * b
        s, d = x * x, 2 * x
        return ((s + d * b) ** 2).sum(-1), s * 3

    run = whole(body, "toy")
    a, b, u = (mx.array(rng.standard_normal((3, 4)), dtype=mx.float32) for _ in range(3))
    cots = [mx.array(rng.standard_normal(shape), dtype=mx.float32) for shape in ((3,), (3, 4))]
    want = mx.vjp(lambda *x: list(plain(*x)), [a, b, u], cots)
    for _ in range(2):  # recorded, then replayed
        got = mx.vjp(lambda *x: list(run(*x)), [a, b, u], cots)
        for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]]):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)
    assert not np.array(got[1][2]).any()


def test_a_whole_body_handing_one_array_to_a_piece_twice_sums_both_cotangents(rng):
    """The same array as two arguments of a piece, and as an argument and an output: every cotangent counts."""
    prod = Piece(lambda x, y: (x * y,), lambda args, outs, cots: (cots[0] * args[1], cots[0] * args[0]))

    def body(a):
        b = mx.sin(a)
        return prod(b, b)[0], b

    def plain(a):
        b = mx.sin(a)
        return b * b, b

    run = whole(body, "twice")
    a = mx.array(rng.standard_normal((5,)), dtype=mx.float32)
    cots = [mx.array(rng.standard_normal((5,)), dtype=mx.float32) for _ in range(2)]
    want = mx.vjp(lambda x: list(plain(x)), [a], cots)[1][0]
    for _ in range(2):
        got = mx.vjp(lambda x: list(run(x)), [a], cots)[1][0]
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,T", [("gated_delta_net", 37), ("power_retention", 21), ("gla", 9), ("kda", 19),
                                    ("rwkv7", 13), ("delta_net", 16)])
def test_chunked_forms_replayed_give_their_pythons_arrays(name, T, rng):
    """The chunked form as one recorded forward and one recorded VJP (``pieces.whole``) against its Python: the
    output, both states' gradients and every input's, GQA where the spec has key heads, cotangents on the final
    state too; recorded without falling back (a fallback warns, which fails here), replayed alike."""
    rec = specs.BUILTINS[name]
    Kin = 6 if name == "power_retention" else 8
    K = Kin * (Kin + 1) // 2 if name == "power_retention" else Kin
    sizes = Sizes(B=2, T=T, H=4, Hk=2 if rec.gqa else 4, Kin=Kin, K=K, V=5)
    xs, h0, do, dht, scale = kernel_inputs(rec, sizes, rng)
    names = list(xs)
    state = list(h0) if rec.has_normalizer else [h0]
    cots = [do, *(dht if rec.has_normalizer else [dht])]
    primals = [mx.array(x, mx.float32) for x in [*xs.values(), *state]]

    def grads():
        def f(*a):
            init = tuple(a[len(names):]) if rec.has_normalizer else a[-1]
            o, st = chunked.forward(rec, dict(zip(names, a[:len(names)])), scale=scale, initial_state=init,
                                    chunk_size=8)
            return [o, *(st if rec.has_normalizer else [st])]
        outs, gs = mx.vjp(f, primals, [mx.array(c, mx.float32) for c in cots])
        return [np.array(x) for x in (*outs, *gs)]

    recorded = []
    real = Replay._record

    def note(self, arrays):
        recorded.append(self.name)
        return real(self, arrays)

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        mp.setattr(Replay, "_record", note)
        with tuning.override(replay_graphs=True):
            on, again = grads(), grads()
    with tuning.override(replay_graphs=False):
        off = grads()
    if name == "power_retention":  # its pieces replay, not its whole body (``chunked.forward``)
        assert {"inter", "inter_vjp"} <= set(recorded)
    else:
        assert any(n.endswith("_whole") for n in recorded) and any(n.endswith("_whole_vjp") for n in recorded)
    for a, b, c in zip(on, again, off):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(c).max())))


def test_recording_kernel_calls_runs_the_python(rng):
    """``chunk_kernels.recording`` (``recgen emit --chunked``) must see each call: replays stand aside."""
    t = tuning.resolve("cpu", replay_graphs=True)
    fn, calls = _counting(_body)
    r = ck.replayed(fn, "body", t)
    x = mx.array(rng.standard_normal((2, 3)), dtype=mx.float32)
    with ck.recording():
        r(x, x)
        r(x, x)
    assert len(calls) == 2 and not r.graphs
    assert ck.replayed(fn, "body", tuning.resolve("cpu", replay_graphs=False)) is fn
