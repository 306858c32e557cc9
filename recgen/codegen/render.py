r"""Render a KernelPlan through a dialect: jinja frames, math from the one printer.

``kernel_sources(plan, dialect)`` returns the MLX form (header + body + buffer lists) of the
recurrent forward and backward kernels. The frames live in ``templates/``; every term and every
partial derivative arrives here as a sympy expression and leaves as printed text.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from ..version import __version__
from ..math import adjoint as adj
from ..spec import ir
from ..spec.analysis import analyze
from .backends.dialect import Dialect
from .lower import KernelPlan, Layout, names
from .printer import kprint

ROLE_VAR = {"a": "ra_", "b": "rb_", "u": "ru_", "r": "rr_", "w": "rw_", "skip": "rs_", "zdecay": "rzd_",
            "zupdate": "rzu_", "bonus": "rbn_"}
REPLICATED = ("zdecay", "zupdate")  # adjoints held identically by every column lane: counted by column 0 only


@lru_cache(maxsize=1)
def template_env() -> jinja2.Environment:
    """The one jinja environment of every kernel frame (strict: an undefined name is an error)."""
    return jinja2.Environment(loader=jinja2.PackageLoader("recgen.codegen", "templates"), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


@dataclass(frozen=True)
class KernelSource:
    """One kernel in MLX's form: the body goes to ``source``, helpers to ``header``."""

    name: str
    header: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    template: tuple[tuple[str, object], ...]  # (name, int | bool | dtype name)

    @property
    def text(self) -> str:
        return self.header + "\n" + self.source


def _decay(plan: KernelPlan, d: Dialect) -> dict:
    """How the decay is computed (once per step, per row, per column or per element) and adjoined."""
    expr = kprint(plan.rec.terms()["decay"], d, names(plan.rec))
    kind = analyze(plan.rec).decay_kind
    adj_sum = "dS_[r][c] * Ss_[s][r][c]"
    return {
        "scalar": {"decl": f"const float D_ = {expr};", "elem": "D_",
                   "adj_decl": "float dD_ = 0.0f;", "adj_acc": f"dD_ += {adj_sum};"},
        "row": {"decl": f"float D_[RK];\n      for (int r = 0; r < RK; ++r) D_[r] = {expr};", "elem": "D_[r]",
                "adj_decl": "float dD_[RK];\n        for (int r = 0; r < RK; ++r) dD_[r] = 0.0f;",
                "adj_acc": f"dD_[r] += {adj_sum};"},
        "col": {"decl": f"float D_[CPL];\n      for (int c = 0; c < CPL; ++c) D_[c] = {expr};", "elem": "D_[c]",
                "adj_decl": "float dD_[CPL];\n        for (int c = 0; c < CPL; ++c) dD_[c] = 0.0f;",
                "adj_acc": f"dD_[c] += {adj_sum};"},
        "elem": {"decl": "", "elem": f"({expr})", "adj_decl": "float dD_[RK][CPL];",
                 "adj_acc": f"dD_[r][c] = {adj_sum};"},
    }[kind] | {"kind": kind}


def _params(plan: KernelPlan, d: Dialect) -> list[dict]:
    out = []
    for x in plan.rec.inputs:
        if x.kind != "param":
            continue
        idx = {(): ("", "h", ""), (ir.I,): ("[RK]", "h * K + klane + LK * r", "r"),
               (ir.J,): ("[CPL]", "h * V + col0 + c", "c"),
               (ir.I, ir.J): ("[RK][CPL]", "(h * K + klane + LK * r) * V + col0 + c", "rc")}[x.index]
        dims, offset, loops = idx
        sub = "".join(f"[{v}]" for v in loops)
        guard = "col0 + c < V ? " if "c" in loops else ""
        tail = " : 0.0f" if guard else ""
        load = f"{x.name}_v{sub} = {guard}static_cast<float>({x.name}_in[{offset}]){tail};"
        for v, n in (("c", "CPL"), ("r", "RK")):
            if v in loops:
                load = f"for (int {v} = 0; {v} < {n}; ++{v}) {load}"
        acc_init = f"{x.name}_g{sub} = 0.0f;"
        for v, n in (("c", "CPL"), ("r", "RK")):
            if v in loops:
                acc_init = f"for (int {v} = 0; {v} < {n}; ++{v}) {acc_init}"
        out.append({"name": x.name, "index": "".join(x.index), "decl": f"{x.name}_v{dims}", "load": load,
                    "acc_decl": f"float {x.name}_g{dims};\n  {acc_init}"})
    return out


def _target(x: ir.Input) -> str:
    sub = "".join({"i": "[r]", "j": "[c]"}[ix] for ix in x.index)
    return f"{x.name}_g{sub}"


def _loops(body: str, vars_: str) -> str:
    for v, n in (("c", "CPL"), ("r", "RK")):
        if v in vars_:
            body = f"for (int {v} = 0; {v} < {n}; ++{v}) {body}"
    return body


def _contribs(plan: KernelPlan, d: Dialect, decay_kind: str) -> list[str]:
    """One statement per partial: target += adjoint(role) * ∂role/∂x over the role's domain."""
    nm = names(plan.rec)
    stmts = []
    for p in plan.adjoint.partials:
        x = plan.rec.input(p.wrt)
        e = kprint(p.expr, d, nm)
        tgt_vars = "".join({"i": "r", "j": "c"}[ix] for ix in x.index)
        if p.role == "decay":
            dvars = {"scalar": "", "row": "r", "col": "c", "elem": "rc"}[decay_kind]
            dsub = "".join(f"[{v}]" for v in dvars)
            stmts.append(_loops(f"{_target(x)} += dD_{dsub} * ({e});", dvars + tgt_vars))
        elif adj.ROLE_DOMAIN[p.role] == (ir.I,):
            guard = "if (col0 == 0) " if p.role in REPLICATED else ""
            stmts.append(guard + _loops(f"{_target(x)} += d{ROLE_VAR[p.role]}[r] * ({e});", "r" + tgt_vars))
        else:  # value-side adjoints are complete on every row lane: count them once
            stmts.append("if (klane == 0) " + _loops(f"{_target(x)} += d{ROLE_VAR[p.role]}[c] * ({e});", "c" + tgt_vars))
    return stmts


def _context(plan: KernelPlan, d: Dialect, layout: Layout, banner: str) -> dict:
    rec, nm = plan.rec, names(plan.rec)
    terms = rec.terms()
    heads = {"key": ("HK", "hk"), "key_gate": ("H", "h")}
    return {
        "d": d, "banner": banner,
        "gqa_expr": "h / (H / HK)" if rec.gqa == "block" else "h % HK",
        "params": _params(plan, d),
        "scalars": [x.name for x in rec.inputs if x.kind == "scalar"],
        "keys": [{"name": x.name, "heads": heads[x.kind][0], "head": heads[x.kind][1]}
                 for x in rec.inputs if x.kind in heads],
        "values": [x.name for x in rec.inputs if x.kind == "value"],
        "key_roles": [{"var": ROLE_VAR[r], "expr": kprint(terms[r], d, nm)} for r in ir.KEY_ROLES if r in terms],
        "value_roles": [{"var": ROLE_VAR[r], "expr": kprint(terms[r], d, nm)} for r in ("w", "skip") if r in terms],
        "decay": _decay(plan, d),
        "transition": "a" in terms, "skip": "skip" in terms, "bonus": "bonus" in terms,
        "pre": rec.step.readout_before_update, "before_decay": rec.transition_before_decay,
        "norm": rec.has_normalizer,
        "vec_state": layout.CPL == 4 and plan.V % 4 == 0,
        "norm_fn": kprint(rec.step.normalizer.fn, d, {ir.N_ARG: "n_"}) if rec.has_normalizer else "",
        "norm_dfn": kprint(plan.adjoint.dN, d, {ir.N_ARG: "n_"}) if rec.has_normalizer else "",
    }


def _header(plan: KernelPlan, d: Dialect) -> str:
    return (f"// generated by recgen {__version__} from spec {plan.rec.name} [{plan.rec.spec_hash()}]: do not edit\n"
            + d.prelude)


def kernel_name(plan: KernelPlan, d: Dialect, kind: str, body: str) -> str:
    digest = hashlib.sha256(body.encode()).hexdigest()[:10]
    return f"recgen_{plan.rec.name}_{kind}_{d.name}_{digest}"


def forward_source(plan: KernelPlan, d: Dialect) -> KernelSource:
    ctx = _context(plan, d, plan.fwd, f"recurrent forward of {plan.rec.name}: state in registers for all T steps")
    body = template_env().get_template("recurrent_fwd.j2").render(**ctx)
    norm = plan.rec.has_normalizer
    ins = tuple(f"{x.name}_in" for x in plan.rec.inputs) + ("rt", "scale_in", "h0") + (("z0",) if norm else ())
    outs = ("o", "ht", "ckpt") + (("zt", "ckptz") if norm else ()) + (("yn",) if plan.normalized_skip else ())
    tmpl = tuple(plan.template(plan.fwd).items())
    return KernelSource(kernel_name(plan, d, "fwd", body), _header(plan, d), body, ins, outs,
                        tmpl + (("SAVE", False), ("OT", "float32")))


def backward_source(plan: KernelPlan, d: Dialect) -> KernelSource:
    ctx = _context(plan, d, plan.bwd, f"recurrent backward of {plan.rec.name}: per chunk, recompute then sweep back")
    ctx.update(contribs=_contribs(plan, d, ctx["decay"]["kind"]))
    body = template_env().get_template("recurrent_bwd.j2").render(**ctx)
    norm = plan.rec.has_normalizer
    ins = (tuple(f"{x.name}_in" for x in plan.rec.inputs) + ("rt", "scale_in", "ckpt", "do_in", "dht")
           + (("ckptz", "dhtz", "ydo_in") if norm else ()))
    outs = tuple(f"d_{x.name}" for x in plan.rec.inputs) + ("dh0",) + (("dz0",) if norm else ())
    return KernelSource(kernel_name(plan, d, "bwd", body), _header(plan, d), body, ins, outs,
                        tuple(plan.template(plan.bwd).items()))

