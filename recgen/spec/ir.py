r"""The recurrence IR: frozen dataclasses for structure, sympy only for per-element math.

Per batch ``b`` and value head ``h`` the state is ``S ∈ R^{K×V}`` (rows ``i`` over the key/state
space, columns ``j`` over values), optionally with a normalizer state ``z ∈ R^K``. One step::

    P   = D ⊙ S_{t-1}                decay D with free indices (), (i), (j) or (i, j)
    Q   = P + a (bᵀ P)               optional rank-1 transition a(i), b(i)   (delta rule: a = -βk, b = k)
                                     (before_decay: Q = P + a (bᵀ S_{t-1}), S_t = (D + a bᵀ) S_{t-1} + u wᵀ)
    S_t = Q + u wᵀ                   outer-product update u(i), w(j)
    z_t = d ⊙ z_{t-1} + u'           optional normalizer state: decay d () or (i), update u'(i)
    y   = S_tᵀ r ;  n = z_tᵀ r       readout r(i)  (readout_before_update: y = S_{t-1}ᵀ r)
    o   = y / N(n) + s + (Σ_i c) w   optional normalizer function N, skip s(j) and bonus c(i)

The pre-update readout and the bonus together express RWKV-6's o_t = (S_{t-1} + diag(u) k_t v_tᵀ)ᵀ r_t:
y reads the state before this step's decay and update, and the bonus c_i = r_i u_i k_i adds the current
token through the update's value factor w. Neither combines with a normalizer (validate() says so).

A transition ``before_decay`` reads the undecayed state: with a key-vector decay diag(d) it is RWKV-7's generalized
delta rule S_t = (diag(d_t) + a_t b_tᵀ) S_{t-1} + u_t w_tᵀ (FLA's DPLR order), with independent a, b. It is not the
default order with b/d (that divides by the decay, which may be 0 or underflow); the default order is the special
case b ← d ⊙ b of it.

Every term is a sympy expression whose free symbols are input symbols (each standing for the
element its index signature names) and ``scale``; the term's free indices are the union of its
symbols' signatures. Shapes are the FLA layouts: per-token scalar ``[B,T,H]``, key ``[B,T,Hk,Kin]``,
key gate ``[B,T,H,K]``, value ``[B,T,H,V]``, parameter ``[H, *signature]``.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, fields
from functools import cached_property

import sympy as sp

from ..errors import SpecError

I, J = "i", "j"
SCALE = sp.Symbol("scale", positive=True)  # the runtime readout scale; None -> Kin**-0.5


# Spec and input names enter kernel sources, kernel names and file paths: ASCII identifiers only.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The names a kernel derives from an input x: buffer x_in, registers x_v and x_n, gradient accumulator x_g,
# gradient buffer d_x. The kernel frames' own names of these forms are in RESERVED_NAMES (a test scans the
# frames), and two inputs must not derive a common name (inputs a_v and d_a would both own d_a_v).
DERIVED_SUFFIXES = ("_in", "_v", "_n", "_g")
DERIVED_PREFIXES = ("d_",)
# Input names that would collide with a name recgen uses itself: the reason is the error message.
RESERVED_NAMES = {
    "scale": "it is rg.scale, the ops' scale= argument and the kernels' scale_in buffer",
    "n": "it is the normalizer function's argument",
    "initial_state": "it is an op keyword", "output_final_state": "it is an op keyword",
    "backend": "it is an op keyword", "check_finite": "it is an op keyword",
    "do": "it is reference.grad's output cotangent and the kernels' do_in buffer",
    "dht": "it is reference.grad's final-state cotangent and a kernel buffer",
    "ydo": "the normalizer's backward kernel has a ydo_in buffer",
}


def derived_names(name: str) -> set[str]:
    """The identifiers kernels derive from an input called ``name``."""
    return {name + s for s in DERIVED_SUFFIXES} | {p + name for p in DERIVED_PREFIXES}


def check_identifier(what: str, name) -> None:
    if not isinstance(name, str) or not IDENTIFIER.match(name):
        raise SpecError(f"{what} {name!r}: must be an ASCII identifier ([A-Za-z_][A-Za-z0-9_]*): it names "
                        "kernels, kernel buffers and emitted files")


@dataclass(frozen=True)
class Input:
    """One array argument of the op.

    kind: ``scalar`` [B,T,H] | ``key`` [B,T,Hk,Kin] | ``key_gate`` [B,T,H,K] | ``value`` [B,T,H,V]
    | ``param`` [H, *index] (per value head, shared over batch and time).
    """

    name: str
    kind: str
    index: tuple[str, ...]

    @cached_property  # made once: every op call binds its inputs by symbol (sympy's constructor is not free)
    def symbol(self) -> sp.Symbol:
        return sp.Symbol(self.name, real=True)

    @property
    def per_token(self) -> bool:
        return self.kind != "param"

    @property
    def key_heads(self) -> bool:
        """True when the input has Hk heads shared by a GQA group of value heads."""
        return self.kind == "key"


@dataclass(frozen=True)
class Feature:
    r"""A feature map applied to a key input, evaluated on the fly by every backend.

    Its name, ``phi(<source>)``, is no identifier, so no input can take it (inputs must be identifiers).

    ``sympow`` of degree p maps x ∈ R^d to the C(d+p−1, p) products over index multisets with √(multinomial)
    coefficients (degree 2: x_a x_b, a ≤ b, √2 on the cross terms), so that φ(x)ᵀφ(y) = (xᵀy)^p. The state rows
    then live in the feature space (``recgen.spec.features``).
    """

    name: str
    source: str
    degree: int = 2

    @cached_property  # made once: every op call binds its inputs by symbol (sympy's constructor is not free)
    def symbol(self) -> sp.Symbol:
        return sp.Symbol(self.name, real=True)

    def width(self, d: int) -> int:
        return math.comb(d + self.degree - 1, self.degree)


@dataclass(frozen=True)
class Rank1:
    """The transition Q = P + a (bᵀ P): a and b are key-indexed vectors. With ``before_decay`` it reads the state
    before this step's decay, Q = P + a (bᵀ S_{t-1}) (RWKV-7 / FLA's DPLR order)."""

    a: sp.Expr
    b: sp.Expr
    before_decay: bool = False


@dataclass(frozen=True)
class Outer:
    """The update u wᵀ: u key-indexed (i), w value-indexed (j)."""

    u: sp.Expr
    w: sp.Expr


@dataclass(frozen=True)
class Normalizer:
    """z_t = d ⊙ z_{t-1} + u';  o = y / N(n) with n = z_tᵀ r. ``fn`` is N as an expression of ``N_ARG``."""

    decay: sp.Expr
    update: sp.Expr
    fn: sp.Expr


N_ARG = sp.Symbol("n", real=True)


@dataclass(frozen=True)
class Step:
    """The terms of one step; see the module docstring for the equations."""

    update: Outer
    readout: sp.Expr
    decay: sp.Expr = sp.Integer(1)
    transition: Rank1 | None = None
    normalizer: Normalizer | None = None
    skip: sp.Expr | None = None
    readout_before_update: bool = False  # y = S_{t-1}ᵀ r: the state before this step's decay and update
    bonus: sp.Expr | None = None  # c(i): o += (Σ_i c_i) w, the current token through the update's value factor


@dataclass(frozen=True)
class Recurrence:
    name: str
    doc: str
    inputs: tuple[Input, ...]
    step: Step
    features: tuple[Feature, ...] = ()
    gqa: str = "block"  # key head of value head h: "block" h // (H/Hk), "tiled" h % Hk
    default_scale: str = "key"  # "key": Kin**-0.5; "one": 1.0

    def __hash__(self) -> int:  # computed once: the dataclass hash walks the sympy terms, and caches key on specs
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    # -- introspection -------------------------------------------------------------------------
    def input(self, name: str) -> Input:
        for x in self.inputs:
            if x.name == name:
                return x
        raise KeyError(name)

    @property
    def has_normalizer(self) -> bool:
        return self.step.normalizer is not None

    @property
    def transition_before_decay(self) -> bool:
        """Whether the rank-1 transition reads S_{t-1} (before the decay) rather than D ⊙ S_{t-1}."""
        return self.step.transition is not None and self.step.transition.before_decay is True

    @property
    def symbols(self) -> dict[sp.Symbol, Input | Feature]:
        table: dict[sp.Symbol, Input | Feature] = {x.symbol: x for x in self.inputs}
        table.update({f.symbol: f for f in self.features})
        return table

    def index_of(self, sym: sp.Symbol) -> tuple[str, ...]:
        if sym == SCALE:
            return ()
        obj = self.symbols[sym]
        return (I,) if isinstance(obj, Feature) else obj.index

    def free_indices(self, expr: sp.Expr) -> tuple[str, ...]:
        idx: set[str] = set()
        for s in expr.free_symbols:
            idx.update(self.index_of(s))
        return tuple(x for x in (I, J) if x in idx)

    def terms(self) -> dict[str, sp.Expr]:
        """Every per-element term of the step by its role name (the adjoint's and printer's keys)."""
        s = self.step
        out = {"decay": sp.sympify(s.decay)}
        if s.transition is not None:
            out["a"], out["b"] = s.transition.a, s.transition.b
        out["u"], out["w"] = s.update.u, s.update.w
        out["r"] = s.readout
        if s.normalizer is not None:
            out["zdecay"], out["zupdate"] = s.normalizer.decay, s.normalizer.update
        if s.skip is not None:
            out["skip"] = s.skip
        if s.bonus is not None:
            out["bonus"] = s.bonus
        return out

    def spec_hash(self) -> str:
        """A stable hash of the structure and every term (srepr is canonical for sympy)."""
        parts = [self.name, self.gqa, self.default_scale]
        parts += [repr(x) for x in self.inputs] + [repr(f) for f in self.features]
        parts += [f"{k}={sp.srepr(v)}" for k, v in self.terms().items()]
        if self.step.normalizer is not None:
            parts.append(sp.srepr(self.step.normalizer.fn))
        if self.step.readout_before_update:  # only when set: the hashes (and goldens) of other specs stay
            parts.append("readout_before_update")
        if self.transition_before_decay:  # likewise
            parts.append("transition_before_decay")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> "Recurrence":
        """Reject malformed specs with an error naming the term and why; returns self."""
        check_identifier("spec name", self.name)
        names = [x.name for x in self.inputs]
        if len(set(names)) != len(names):
            raise SpecError(f"{self.name}: duplicate input names in {names}")
        self._check_input_names()
        for x in self.inputs:
            if x.kind not in KIND_INDEX and x.kind != "param":
                raise SpecError(f"input {x.name!r}: unknown kind {x.kind!r}")
            if x.kind == "param" and not set(x.index) <= {I, J}:
                raise SpecError(f"input {x.name!r}: parameter index {x.index} must be a subset of ('i', 'j')")
        for f in self.features:
            src = self.input(f.source) if f.source in names else None
            if src is None or src.kind != "key":
                raise SpecError(f"feature {f.name!r}: source {f.source!r} must be a key input")
        if self.default_scale not in ("key", "one"):
            raise SpecError(f"{self.name}: default_scale must be 'key' (Kin**-0.5) or 'one' (1.0), "
                            f"got {self.default_scale!r}")
        if self.gqa not in ("block", "tiled"):
            raise SpecError(f"{self.name}: gqa must be 'block' or 'tiled', got {self.gqa!r}")
        allowed = {"decay": (I, J), "a": (I,), "b": (I,), "u": (I,), "w": (J,), "r": (I,),
                   "zdecay": (I,), "zupdate": (I,), "skip": (J,), "bonus": (I,)}
        known = set(self.symbols) | {SCALE}
        for role, expr in self.terms().items():
            if not isinstance(expr, sp.Expr):
                raise SpecError(f"term {ROLE_NAMES[role]}: expected a sympy expression, got {type(expr).__name__}")
            unknown = expr.free_symbols - known
            if unknown:
                raise SpecError(f"term {ROLE_NAMES[role]} = {expr}: unknown symbols "
                                f"{sorted(map(str, unknown))}; use the function's inputs")
            bad = set(self.free_indices(expr)) - set(allowed[role])
            if bad:
                raise SpecError(f"term {ROLE_NAMES[role]} = {expr}: has index {sorted(bad)} but may only "
                                f"depend on {allowed[role] or 'no index'} ({ROLE_WHY[role]})")
        self._check_functions()
        self._check_key_space()
        self._check_decays()
        self._check_readout_extensions()
        if self.step.normalizer is not None:
            extra = self.step.normalizer.fn.free_symbols - {N_ARG}
            if extra:
                raise SpecError(f"normalizer function N(n) = {self.step.normalizer.fn} may only use n, "
                                f"found {sorted(map(str, extra))}")
        return self

    def _check_functions(self) -> None:
        """Every function a term or the normalizer applies is one every backend computes (``fns.FUNCTIONS``)."""
        from .fns import FUNCTIONS

        exprs = [(f"term {ROLE_NAMES[role]}", e) for role, e in self.terms().items()]
        if self.step.normalizer is not None:
            exprs.append(("normalizer function N(n)", self.step.normalizer.fn))
        for where, e in exprs:
            for node in sp.preorder_traversal(e):
                name = type(node).__name__
                if isinstance(node, (sp.Function, sp.Max, sp.Min)) and name not in FUNCTIONS:
                    raise SpecError(f"{where} = {e}: recgen does not compute the function {name}; the functions "
                                    f"it computes: {', '.join(sorted(FUNCTIONS))}")

    def _check_decays(self) -> None:
        """Every decay has an exact logarithm (the chunked forms need it), and ``before_decay`` is a bool. (A rank-1
        transition with a value-indexed or full (i, j) decay is accepted: the kernels and the reference step it
        like any other, and the ``mlx`` backend steps it token by token, having no chunked form for it.)"""
        from .decay import log_decay

        terms = self.terms()
        for role in ("decay", "zdecay"):
            if role in terms and log_decay(terms[role]) is None:
                raise SpecError(
                    f"term {ROLE_NAMES[role]} = {terms[role]}: can be negative for some inputs (sympy cannot prove it "
                    "nonnegative), and the chunked form takes log D. Write it nonnegative by construction: "
                    "rg.exp(x), rg.sigmoid(x), x**2, Abs(x) or products of those (a 0/1 mask m as Abs(m): "
                    "a decay of 0 is a reset)")
        tr = self.step.transition
        if tr is not None and not isinstance(tr.before_decay, bool):
            raise SpecError(f"{self.name}: rank1(..., before_decay=) must be True or False, got {tr.before_decay!r}")

    def _check_readout_extensions(self) -> None:
        """The pre-update readout and the bonus: a bool flag, and no normalizer (no backend computes n = z_{t-1}ᵀ r
        or orders the bonus against N(n))."""
        s = self.step
        if not isinstance(s.readout_before_update, bool):
            raise SpecError(f"{self.name}: readout_before_update must be True or False, got "
                            f"{s.readout_before_update!r}")
        if s.normalizer is None:
            return
        if s.readout_before_update:
            raise SpecError(f"{self.name}: readout_before_update=True with a normalizer is not supported (no backend "
                            "reads the normalizer state before the update); drop one of them")
        if s.bonus is not None:
            raise SpecError(f"term {ROLE_NAMES['bonus']} = {s.bonus}: a bonus with a normalizer is not supported (no "
                            "backend orders it against the normalizer's division); drop one of them")

    def _check_input_names(self) -> None:
        owner: dict[str, str] = {}
        for x in self.inputs:
            check_identifier("input", x.name)
            if x.name in RESERVED_NAMES:
                raise SpecError(f"input {x.name!r}: the name is reserved ({RESERVED_NAMES[x.name]}); rename it")
            for d in sorted(derived_names(x.name)):
                if d in owner:
                    raise SpecError(f"inputs {owner[d]!r} and {x.name!r}: both would name the kernel variable "
                                    f"{d!r}; rename one")
                owner[d] = x.name

    def _check_key_space(self) -> None:
        """Raw key inputs and feature maps live in different row spaces: never mix them."""
        feats = {f.symbol for f in self.features}
        raw = {x.symbol for x in self.inputs if x.kind in ("key", "key_gate")}
        used_feat = used_raw = None
        for role, expr in self.terms().items():
            syms = expr.free_symbols
            if syms & feats:
                used_feat = role
            if syms & raw:
                used_raw = role
        if used_feat and used_raw:
            raise SpecError(f"term {ROLE_NAMES[used_raw]} uses a raw key input while term "
                            f"{ROLE_NAMES[used_feat]} uses a feature map: the state rows must be one space")
        degrees = sorted({f.degree for f in self.features})
        if len(degrees) > 1:
            raise SpecError(f"feature maps of degrees {degrees} ({', '.join(f.name for f in self.features)}): "
                            "the state rows must be one space")

    def __call__(self, /, *args, **kwargs):
        """A spec is data: the op that runs it is ``recgen.load(spec)`` (the IR knows no runtime)."""
        raise TypeError(f"a Recurrence is a spec, not an op: run it as recgen.load({self.name})(...) "
                        f"(built-ins: recgen.ops.{self.name})")

    def __repr__(self) -> str:  # readable, one term per line
        lines = [f"Recurrence {self.name} [{self.spec_hash()}]"]
        lines += [f"  input {x.name}: {x.kind}{list(x.index)}" for x in self.inputs]
        lines += [f"  feature {f.name} = sympow{f.degree}({f.source})" for f in self.features]
        lines += [f"  {ROLE_NAMES[r]:<22} {e}" for r, e in self.terms().items()]
        if self.step.readout_before_update:
            lines.append(f"  {'readout':<22} before the update (S_{{t-1}})")
        if self.transition_before_decay:
            lines.append(f"  {'transition':<22} reads the state before the decay (S_{{t-1}})")
        if self.step.normalizer is not None:
            lines.append(f"  {'normalizer N(n)':<22} {self.step.normalizer.fn}")
        return "\n".join(lines)


KIND_INDEX = {"scalar": (), "key": (I,), "key_gate": (I,), "value": (J,)}

# The domain of each role of the step: the decay lives on (i, j), key-side roles on i, value-side ones on j.
ROLE_DOMAIN = {"decay": (I, J), "a": (I,), "b": (I,), "u": (I,), "w": (J,), "r": (I,), "zdecay": (I,),
               "zupdate": (I,), "skip": (J,), "bonus": (I,)}
KEY_ROLES = tuple(r for r, d in ROLE_DOMAIN.items() if d == (I,))
VALUE_ROLES = tuple(r for r, d in ROLE_DOMAIN.items() if d == (J,))

ROLE_NAMES = {"decay": "decay D", "a": "transition a", "b": "transition b", "u": "update u",
              "w": "update w", "r": "readout r", "zdecay": "normalizer decay d",
              "zupdate": "normalizer update u'", "skip": "skip s", "bonus": "bonus c"}
ROLE_WHY = {"decay": "it scales S elementwise", "a": "Q = P + a (bᵀP) needs a key vector",
            "b": "Q = P + a (bᵀP) needs a key vector",
            "u": "the update u wᵀ is an outer product: u is the key side",
            "w": "the update u wᵀ is an outer product: w is the value side",
            "r": "the readout Sᵀr contracts the key side", "zdecay": "z is a key-sized vector",
            "zupdate": "z is a key-sized vector", "skip": "the skip adds to the value-sized output",
            "bonus": "the bonus (Σ_i c_i) w is summed over the key side"}

