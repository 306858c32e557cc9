"""The kernel subcommands of the CLI: ``recgen emit`` and ``recgen check``."""
from __future__ import annotations

import argparse
import shlex
import sys
from functools import partial

from rich.console import Console
from rich.table import Table

from .errors import CliError

TARGETS = ("metal", "cuda")


def parse_sizes(text: str) -> dict[str, int]:
    """'K=128,V=128,H=16,HK=16' -> dict; every key one of K, V, H, HK."""
    out = {"K": 128, "V": 128, "H": 16, "HK": 16}
    for part in filter(None, text.split(",")):
        key, _, val = part.partition("=")
        if key not in out or not val.isdigit() or int(val) <= 0:
            raise ValueError(f"--sizes: bad entry {part!r}; expected K=,V=,H=,HK= with positive integers")
        out[key] = int(val)
    return out


def add_emit(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="a built-in name or path/to/file.py:function")
    p.add_argument("--target", choices=TARGETS, help="dialect to write")
    p.add_argument("--all", action="store_true", help="write every target")
    p.add_argument("-o", "--out", default="build", help="output directory (default: build)")
    p.add_argument("--sizes", default="", help="register-shaping sizes, e.g. K=128,V=128,H=16,HK=16")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="dtype of the input buffers")
    p.add_argument("--chunked", action="store_true",
                   help="the chunked form's kernels (training, prefill) and their call order instead")
    p.add_argument("--chunk", type=int, default=64, help="chunk length of --chunked (default: 64)")


def cmd_emit(args: argparse.Namespace, console: Console) -> int:
    from .spec.resolve import resolve_spec
    from .emit import emit

    if not args.all and not args.target:
        raise CliError("name a --target (metal or cuda) or pass --all")
    rec = resolve_spec(args.spec)
    sizes = parse_sizes(args.sizes)
    command = "recgen " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "recgen emit"
    if args.chunked and (args.chunk < 1 or args.chunk & (args.chunk - 1)):
        raise CliError(f"--chunk: expected a power of two, got {args.chunk}")
    for target in (TARGETS if args.all else (args.target,)):
        if args.chunked:
            from .emit_chunked import emit_chunked

            paths = emit_chunked(rec, target, args.out, C=args.chunk, dtype=args.dtype, command=command, **sizes)
        else:
            paths = emit(rec, target, args.out, dtype=args.dtype, command=command, **sizes)
        for path in paths:
            console.print(f"wrote {path}")
    return 0


def _state_errs(name: str, a, b, rel) -> dict:
    """{name: error}, or one entry per part (name.S, name.z) of a normalizer's (S, z) state."""
    if isinstance(b, (tuple, list)):
        return {f"{name}.{part}": rel(x, y) for part, x, y in zip("Sz", a, b)}
    return {name: rel(a, b)}


def add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="a built-in name or path/to/file.py:function")
    p.add_argument("--sanitizer", choices=("address", "thread"), help="run the CPU emulation under a sanitizer")
    p.add_argument("--sizes", default="K=8,V=12,H=4,HK=2", help="small sizes for the emulated run")
    p.add_argument("--T", type=int, default=5, help="sequence length of the emulated run")


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    """Metal verification on this machine (no Apple GPU): capture, type check, limits, CPU run vs reference."""
    import numpy as np

    from . import specs
    from .math import reference
    from .spec.resolve import resolve_spec
    from .spec.layouts import Sizes
    from .testing import kernel_inputs, reachable_state, rel_err
    from .verify.key_blocks import emulate_key_blocks
    from .verify.kernels import Report, VerificationError, emulate
    from .verify.typecheck import clang_problem

    problem = clang_problem()
    if problem:  # first: an old clang would fail every layer with messages about Metal's types
        raise CliError(problem)
    rec = resolve_spec(args.spec)
    s = parse_sizes(args.sizes)
    blocks = rec is specs.power_retention  # simple_gla's kernels over its key blocks (recgen.key_blocks)
    K = rec.features[0].width(s["K"]) if blocks else s["K"]
    sizes = Sizes(2, args.T, s["H"], s["HK"], s["K"], K, s["V"])
    rng = np.random.default_rng(0)
    xs, h0, do, dht, scale = kernel_inputs(rec, sizes, rng)
    run = partial(emulate, rec)
    if blocks:
        h0, run = reachable_state(sizes, rng), emulate_key_blocks
    report = Report()
    failed = None
    try:
        o, ht, g = run(xs, initial_state=h0, do=do, dht=dht, scale=scale, sanitizer=args.sanitizer, report=report)
    except VerificationError as e:
        failed = str(e)
    ferrs = {}
    if blocks and failed is None:  # and its decode step and chunk products over φ's rows (their own kernels)
        from .verify.feature_kernels import check_feature_kernels

        try:
            ferrs = check_feature_kernels(s["K"], s["V"], sanitizer=args.sanitizer, report=report)
        except VerificationError as e:
            failed = str(e)
    how = " as simple_gla kernels over key blocks, and its feature kernels" if blocks else ""
    table = Table(title=f"recgen check {rec.name}{how}: Metal verified on the CPU, not on Apple hardware")
    for col in ("kernel", "layer", "result"):
        table.add_column(col)
    for name, layer, ok, detail in report.layers:
        table.add_row(name, layer, "[green]ok[/]" if ok else f"[red]{detail[:200]}[/]")

    def judge(against: str, k: str, e: float, bound: float) -> None:
        nonlocal failed
        ok = e <= bound
        failed = failed or (None if ok else f"{k}: relative error {e:.2e}")
        table.add_row(against, k, f"[{'green' if ok else 'red'}]{e:.2e}[/]")

    if failed is None:
        o_r, ht_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
        g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
        errs = {"o": rel_err(o, o_r)} | _state_errs("final_state", ht, ht_r, rel_err)
        for k in g_r:
            errs |= _state_errs(f"d{k}", g[k], g_r[k], rel_err)
        for k, e in errs.items():
            judge("vs float64 reference", k, e, 1e-5 if k == "o" or k.startswith("final_state") else 1e-4)
    for k, e in ferrs.items():
        judge("vs float64 numpy", k, e, 1e-5)
    console.print(table)
    if failed:
        console.print(f"[bold red]FAILED[/]: {failed}")
        return 1
    console.print("[bold green]all layers passed[/]")
    return 0
