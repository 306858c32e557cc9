"""``recgen emit``: kernel files for hosts outside Python, plus the MLX form and a manifest.

For each kernel (recurrent forward, forward with checkpoints, backward) it writes
  <entry>.<ext>       standalone source: full signature with buffer indices (Metal) or an
                      ``extern "C" __global__`` entry (CUDA), template constants fixed;
  <entry>.mlx.<ext>   MLX's form: the header and the body as passed to ``mx.fast.*_kernel``;
and ``manifest.json``: buffers (index, name, dtype, shape), constants, grid and threadgroup recipe.
Register-shaping sizes are fixed at emit time (``--sizes K=128,V=128,H=16,HK=16``); T and B stay
runtime values in the ``rt`` buffer.

Power retention has no recurrent kernels of its own: it is written as the ``simple_gla`` kernels of its key blocks
(``recgen.key_blocks``), entries named ``recgen_power_retention_blocks_*``, with the composition (φ's pairs, the
block layout, the readout) in its manifest under ``"composition"``, and its decode step as the feature decode
kernel (kind ``"decode"``: one step split over φ's rows, partial sums a host adds). The chunked form's kernels
(training, prefill) are ``recgen.emit_chunked``'s (``recgen emit --chunked``).
"""
from __future__ import annotations

import json
from pathlib import Path

from .version import __version__

from . import specs
from .key_blocks import key_blocks
from .key_blocks import manifest as key_blocks_manifest
from .spec import ir
from .codegen.backends import get
from .codegen.backends.dialect import Dialect
from .runtime.recurrent import backward_launch, forward_launch
from .codegen.lower import plan, unsupported
from .codegen.render import template_env
from .errors import UnsupportedKernel
from .spec.layouts import Sizes, input_dims

AXIS_NAMES = {"Hk": "HK", "Kin": "K"}  # the template constants' names of the layouts' axes
# The buffers a recurrent kernel takes beside the spec's inputs: (element type, "io" being the inputs' type; shape).
STATE_BUFFERS = {
    "rt": ("int", "[2] = (T, B)"), "scale_in": ("float", "[1]"),
    "h0": ("float", "[B,H,K,V]"), "z0": ("float", "[B,H,K]"),
    "ckpt": ("float", "[B,H,ceil(T/C),K,V]"), "ckptz": ("float", "[B,H,ceil(T/C),K]"),
    "do_in": ("io", "[B,T,H,V]"), "dht": ("float", "[B,H,K,V]"), "dhtz": ("float", "[B,H,K]"),
    "ydo_in": ("float", "[B,T,H] = sum_j do_j y_j / N(n) (o_j without a skip term)"),
}


def _shape(x: ir.Input) -> str:
    return "[" + ",".join(AXIS_NAMES.get(a, a) for a in input_dims(x)) + "]"


def _buffers(rec: ir.Recurrence, launch, d: Dialect, dtype: str) -> list[dict]:
    """The standalone signature: the kernel source's own inputs, then its outputs, in order."""
    T = d.standalone_dtypes
    spec_inputs = {f"{x.name}_in": x for x in rec.inputs}
    bufs = []
    for name in launch.source.inputs:
        if name in spec_inputs:
            bufs.append((name, T[dtype], _shape(spec_inputs[name]), True))
        else:
            ctype, shape = STATE_BUFFERS[name]
            bufs.append((name, T[dtype] if ctype == "io" else ctype, shape, True))
    for name, (shape, dt) in zip(launch.source.outputs, launch.outputs):
        bufs.append((name, T[dtype] if name == "o" else "float", str(list(shape)), False))
    return [buffer(d, i, *b, small=b[0] in ("rt", "scale_in")) for i, b in enumerate(bufs)]


def buffer(d: Dialect, index: int, name: str, ctype: str, shape: str, is_in: bool, small: bool = False) -> dict:
    """One buffer of a standalone signature (``small``: a read-only scalar table, in Metal's constant space)."""
    space = d.constant_space if small and d.constant_space else d.global_space
    const = "const " if is_in else ""
    return {"index": index, "name": name, "dtype": ctype, "shape": shape, "input": is_in,
            "decl": f"{const}{space}{ctype}* {name}"}


def _kind(v) -> str:
    """The C++ kind of a template value: a dtype name is a type, then bool before int (bool is an int)."""
    return "typename" if isinstance(v, str) else "bool" if isinstance(v, bool) else "int"


def _spell(v, d: Dialect) -> str:
    return d.standalone_dtypes[v] if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def kernel_buffers(d: Dialect, launch, user) -> list[dict]:
    """A chunk kernel's standalone signature: its user buffers (``user``: (shape, dtype name) of each, as called),
    its runtime tables, then its outputs, in the order of the kernel's source."""
    T = d.standalone_dtypes
    runtime = {n: (dt, len(v)) for n, v, dt in launch.runtime}
    names = [n for n in launch.source.inputs if n not in runtime]
    rows = [(n, T[dt], str(list(shape)), True, False) for n, (shape, dt) in zip(names, user)]
    rows += [(n, "int" if dt == "int32" else T[dt], f"[{size}]", True, size <= 8) for n, (dt, size) in runtime.items()]
    rows += [(n, T[dt], str(list(shape)), False, False) for n, (shape, dt) in zip(launch.source.outputs, launch.outputs)]
    order = {n: i for i, n in enumerate(list(launch.source.inputs) + list(launch.source.outputs))}
    rows.sort(key=lambda r: order[r[0]])
    return [buffer(d, i, n, ctype, shape, is_in, small) for i, (n, ctype, shape, is_in, small) in enumerate(rows)]


def template_values(d: Dialect, tmpl: dict) -> dict:
    """A launch's template constants for a manifest: dtypes spelled as the standalone buffers are."""
    return {n: (d.standalone_dtypes[v] if isinstance(v, str) else v) for n, v in tmpl.items()}


def write_kernel(d: Dialect, launch, entry: str, bufs: list, banner: str, out: Path, prelude: str) -> tuple[Path, Path]:
    """``launch``'s kernel as a standalone source (signature ``bufs``, template constants fixed, ``prelude`` before
    it) and in MLX's form (header and body); returns both paths."""
    src = launch.source
    tmpl = dict(launch.template)
    kinds = {n: _kind(v) for n, v in tmpl.items()}
    values = {n: _spell(v, d) for n, v in tmpl.items()}
    ctx = {"banner": banner, "prelude": prelude, "body": src.source, "buffers": bufs, "entry": entry,
           "fn": entry + "_impl",
           "bounds": ", ".join(map(str, launch.bounds or launch.threadgroup[:1])),  # the launch's, as it runs
           "template_params": ", ".join(f"{kinds[n]} {n}" for n in tmpl),
           "template_args": ", ".join(values.values()),
           "constants": [f"using {n} = {values[n]};" if kinds[n] == "typename" else
                         f"constexpr {kinds[n]} {n} = {values[n]};" for n in tmpl]}
    path = out / f"{entry}.{d.ext}"
    path.write_text(template_env().get_template(f"standalone.{d.ext}.j2").render(**ctx))
    mlx_path = out / f"{entry}.mlx.{d.ext}"
    mlx_path.write_text(f"{banner}\n// MLX form: header\n{src.header}\n// MLX form: source (the body)\n{src.source}")
    return path, mlx_path


def emit(rec: ir.Recurrence, target: str, outdir: str | Path, K: int, V: int, H: int, HK: int,
         dtype: str = "float32", command: str = "") -> list[Path]:
    """Write the kernels of ``rec`` for ``target`` into ``outdir``; returns the written paths. K is the raw key
    width (power retention's state has d(d+1)/2 rows of it)."""
    d = get(target)
    if dtype not in d.standalone_dtypes:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(d.standalone_dtypes)}")
    if rec is specs.power_retention:
        sizes = Sizes(1, 1, H, HK, K, rec.features[0].width(K), V)
        kb = key_blocks(sizes)
        return _emit_kernels(specs.simple_gla, d, target, outdir, kb.inner(sizes), dtype, command,
                             name=f"{rec.name}_blocks", manifest_spec=rec,
                             extra={"composition": key_blocks_manifest(kb, K)}, more=_feature_decode(d, K, V, H))
    why = unsupported(rec)
    if why:  # before any size is derived or any file written
        raise UnsupportedKernel(f"{rec.name} has no kernels to emit: {why}")
    return _emit_kernels(rec, d, target, outdir, Sizes(1, 1, H, HK, K, K, V), dtype, command)


def _feature_decode(d: Dialect, K: int, V: int, H: int) -> dict:
    """Power retention's decode step as the feature decode kernel (float32 buffers, B = 1 at emit: the grid is
    B·H·NB threadgroups), for the manifest's kernels beside the composition: kind -> (launch, buffers, note)."""
    from .runtime.chunk_kernels import feature_decode_launch

    launch = feature_decode_launch(d.name, H, K, V, True)
    F = K * (K + 1) // 2
    user = [((H, K), "float32"), ((H, K), "float32"), ((H, V), "float32"), ((H,), "float32"), ((H, F, V), "float32"),
            ((H, F), "float32")]
    note = ("one decode step for B*H heads (rows = heads): q, k the raw keys (value heads expanded), w = v, decay = "
            "exp(g); S, z the state in phi's packed rows; pa, pb the first two columns of the composition's pairs. "
            "o = scale^2 * sum(part[..., :V], 1) / (scale^2 * sum(part[..., V], 1) + 1e-2), the partials summed over "
            "NB in order (recgen.chunked.features)")
    return {"decode": (launch, kernel_buffers(d, launch, user), note)}


def _emit_kernels(rec: ir.Recurrence, d: Dialect, target: str, outdir: str | Path, sizes: Sizes, dtype: str,
                  command: str, name: str | None = None, manifest_spec: ir.Recurrence | None = None,
                  extra: dict | None = None, more: dict | None = None) -> list[Path]:
    """The recurrent kernels of ``rec`` at ``sizes``, entries named after ``name`` (default the spec's), the
    manifest after ``manifest_spec`` (default ``rec``) with ``extra`` entries; ``more``: other kernels, kind ->
    (launch, buffers, note)."""
    name = name or rec.name
    top = manifest_spec or rec
    p = plan(rec, sizes, decode=False)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    banner = (f"// generated by recgen {__version__} from spec {top.name} [{top.spec_hash()}]: do not edit\n"
              f"// command: {command or 'recgen emit'}")
    launches = {"fwd": forward_launch(p, d, sizes, 1.0, dtype, save=False),
                "fwd_ckpt": forward_launch(p, d, sizes, 1.0, dtype, save=True),
                "bwd": backward_launch(p, d, sizes, 1.0)}
    written, manifest = [], {"recgen": __version__, "spec": top.name, "spec_hash": top.spec_hash(), "target": target,
                             "dtype": dtype, "command": command, **(extra or {}), "kernels": []}
    note = ("rt = [T, B] (int32), scale_in = [scale]; outputs summed over their leading partial axis where the "
            "shape has one (see recgen.runtime.recurrent.finish_grads)")
    kernels = {kind: (launch, _buffers(rec, launch, d, dtype), note) for kind, launch in launches.items()}
    for kind, (launch, bufs, note) in (kernels | (more or {})).items():
        src = launch.source
        entry = f"recgen_{name}_{kind}_{target}_{dtype}"
        helpers = "" if kind in launches else "\n" + src.header  # a recurrent header is the prelude; a chunk one adds
        path, mlx_path = write_kernel(d, launch, entry, bufs, banner, out, d.prelude + helpers)
        written += [path, mlx_path]
        grid, tg = launch.grid, launch.threadgroup
        manifest["kernels"].append({
            "kind": kind, "entry": entry, "file": path.name, "mlx_file": mlx_path.name, "mlx_name": src.name,
            "template": template_values(d, dict(launch.template)),
            "buffers": [{k: b[k] for k in ("index", "name", "dtype", "shape", "input")} for b in bufs],
            "threadgroup": list(tg),
            "grid_threadgroups": [f"{grid[0] // tg[0]}", "B*H", "1"] if kind in launches else
                                 ["B*H*NB", "1", "1"],
            "note": note,
        })
    mpath = out / f"{top.name}.{target}.manifest.json"
    mpath.write_text(json.dumps(manifest, indent=1) + "\n")
    return written + [mpath]
