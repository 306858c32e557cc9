"""``recgen bench``: the command line around ``recgen.bench`` (a progress bar, a table, optional JSON)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

GPU_SHAPE, CPU_SHAPE = "4,4096,16,128", "2,1024,4,64"
ROWS = (("fwd", "fwd ms"), ("fwdbwd", "fwd+bwd ms"), ("peak_fwd", "peak fwd GiB"),
        ("peak_fwdbwd", "peak fwd+bwd GiB"), ("decode", "decode ms a step (T = 1)"))


def _csv(text: str) -> tuple:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="a built-in name or path/to/file.py:function")
    p.add_argument("--shape", help=f"B,T,H,D or B,T,H,K,V (default: {GPU_SHAPE} on a GPU, {CPU_SHAPE} on the CPU)")
    p.add_argument("--key-heads", type=int, help="key heads shared by the H value heads (GQA; default: H)")
    p.add_argument("--dtype", default="bfloat16", help="input dtype: float32, float16 or bfloat16 (default bfloat16)")
    p.add_argument("--backend", default="auto", help="auto (the op's own choice), metal, cuda or mlx")
    p.add_argument("--passes", default="fwd,fwdbwd,peak", help="comma list of fwd, fwdbwd, peak, decode (T = 1 "
                   "steps chained through the state, pipelined as a generate loop)")
    p.add_argument("--baseline", default="", help="comma list of naive (the per-token MLX loop), fla (FLA, "
                                                   "torch in a separate process)")
    p.add_argument("--fla-timeout", type=float, default=None, metavar="S",
                   help="seconds the FLA worker may take, its Triton autotuning included (default: "
                        "recgen.bench.FLA_TIMEOUT_S, 270)")
    p.add_argument("--repeat", type=int, help="chained calls a round (default: enough for ~0.25 s)")
    p.add_argument("--compiled", action="store_true", help="each call as one mx.compile'd function, as a compiled "
                                                             "training step runs it (FLA runs eager either way)")
    p.add_argument("--json", metavar="PATH", help="write every number, the shape, device, versions and method")


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    import mlx.core as mx

    from . import bench
    from .spec.resolve import resolve_spec

    rec = resolve_spec(args.spec)
    shape = bench.Shape.parse(args.shape or (GPU_SHAPE if mx.default_device() == mx.gpu else CPU_SHAPE))
    shape = shape.with_key_heads(args.key_heads)
    passes, baselines = _csv(args.passes), _csv(args.baseline)
    bench.check_args(passes, baselines, args.dtype, args.backend)
    if args.fla_timeout is not None and args.fla_timeout <= 0:
        raise ValueError(f"--fla-timeout: expected a positive number of seconds, got {args.fla_timeout}")
    labels = bench.plan(passes, baselines)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"{rec.name} {shape.text()}", total=len(labels))
        seen = []

        def on_step(label):
            if seen:
                progress.advance(task)
            seen.append(label)
            progress.update(task, description=f"{rec.name} {shape.text()}: {label}")

        result = bench.run(rec, shape, args.dtype, args.backend, passes, baselines, args.repeat, on_step,
                           fla_timeout=args.fla_timeout or bench.FLA_TIMEOUT_S, compiled=args.compiled)
        progress.update(task, completed=len(labels))
    console.print(header(result))
    console.print(table(result, baselines))
    notes = {}
    for m in result.measures:
        if m.note:
            notes.setdefault((m.impl, m.note), []).append(m.kind)
    for (impl, note), kinds in notes.items():
        console.print(f"[yellow]{impl} {', '.join(kinds)}[/]: {note}")
    first = [(label, m.extra["first_call_s"]) for kind, label in ROWS
             if (m := result.get("recgen", kind)) is not None and "first_call_s" in m.extra]
    if first:
        console.print("first calls (kernel builds, tracing): " + ", ".join(f"{label.rsplit(' ', 1)[0]} {s:.3g} s"
                                                                            for label, s in first))
    dec = result.get("recgen", "decode")
    if dec is not None:
        console.print(f"decode: a copy of the same state bytes takes {dec.extra['copy_ms']:.4g} ms: the step runs at "
                      f"{dec.extra['of_copy']:.0%} of copy bandwidth")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_json(), indent=1))
        console.print(f"wrote {path}")
    return 0


def _fmt(m) -> str:
    if m is None:
        return ""
    if m.value is None:
        return "[yellow]skipped[/]"
    return f"{m.value:.4g}"


def header(result) -> str:
    s, dev = result.shape, result.environment["device"]
    return (f"[bold]recgen bench {result.spec}[/]: B={s.B} T={s.T} H={s.H} K={s.K} V={s.V}, {result.dtype}, "
            f"{dev.get('device_name', dev['default_device'])}, backend {result.backend_used}, chained "
            + ("compiled calls" if result.environment.get("compiled") else "calls"))


def table(result, baselines: tuple) -> Table:
    t = Table()
    t.add_column("measure", no_wrap=True)
    t.add_column("recgen", justify="right")
    for b in baselines:
        t.add_column(b, justify="right")
        t.add_column(f"recgen/{b}", justify="right")
    for kind, label in ROWS:
        mine = result.get("recgen", kind)
        if mine is None:
            continue
        row = [label, _fmt(mine)]
        for b in baselines:
            r = result.ratio(kind, b)
            row += [_fmt(result.get(b, kind)), "" if r is None else f"{r:.2f}"]
        t.add_row(*row)
    return t
