"""Values of one tuning field against each other in one process, their rounds interleaved.

    python benchmarks/ab_tuning.py power_retention --shape 2,4096,8,64 --field feature_jac_groups --values 8 4 2

Separate processes spread about ±5% on the H100 (clocks, allocation, what ran before), more than the changes a
tuning field makes; here every value runs in each round, the order rotating from round to round, so drift and
position fall on all of them alike. Each round is ``recgen bench``'s chained measure (``bench.time_chained``: the
op's calls each waiting on the last, the op's defaults but the field, set through ``tuning.override``). Prints each
round, the medians, and each value's peak memory of one synchronized call.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import fields


def parse_value(field: str, field_type, text: str, environment: dict):
    """A command-line value as the field's environment variable spells it (``RECGEN_KERNEL_CACHE=off``), else in
    the field's type (bools as 0/1)."""
    parsers = [parse for name, parse in environment.values() if name == field]
    if parsers:
        return parsers[0](text)
    kind = str(field_type)
    if "bool" in kind:
        return text not in ("0", "false", "False")
    if "int" in kind:
        return int(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec")
    p.add_argument("--shape", default="2,4096,8,64")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--field", required=True, help="a recgen.tuning.Tuning field")
    p.add_argument("--values", nargs="+", required=True)
    p.add_argument("--pass", dest="kind", choices=("fwd", "fwdbwd"), default="fwdbwd")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json")
    args = p.parse_args()

    import mlx.core as mx

    from recgen import bench, load, tuning

    types = {f.name: f.type for f in fields(tuning.Tuning)}
    if args.field not in types:
        p.error(f"--field {args.field!r}: not a Tuning field")
    values = [parse_value(args.field, types[args.field], v, tuning.ENVIRONMENT) for v in args.values]
    rec = load(args.spec).rec
    xs, do = bench.make_inputs(rec, bench.Shape.parse(args.shape), args.dtype)
    s = bench.steps(bench.recgen_forward(rec, "auto"), xs, do)
    call, step = (s.fwd, s.fwd_step) if args.kind == "fwd" else (s.fwdbwd, s.fwdbwd_step)

    sync, peak = {}, {}
    for v in values:  # warm each (kernel builds), then size the chain by the slowest
        with tuning.override(**{args.field: v}):
            mx.eval(call())
            bench.time_chained(step, s.start, 1, 1)
            sync[v] = statistics.median(bench.time_sync(call))
            peak[v] = bench.peak_gib(call)
    calls = bench.calls_for(max(sync.values()), None)
    rounds = {v: [] for v in values}
    for r in range(args.rounds):
        order = values[r % len(values):] + values[:r % len(values)]
        for v in order:
            with tuning.override(**{args.field: v}):
                rounds[v].append(bench.time_chained(step, s.start, calls, 1)[0])
        print(f"round {r}: " + "  ".join(f"{args.field}={v} {rounds[v][-1]:.3f} ms" for v in values), flush=True)
    print(f"{args.spec} {args.shape} {args.dtype} {args.kind}, {calls} chained calls a round, {args.rounds} rounds:")
    for v in values:
        print(f"  {args.field}={v}: median {statistics.median(rounds[v]):.3f} ms (min {min(rounds[v]):.3f}), "
              f"synchronized {sync[v]:.3f} ms, peak {peak[v]:.3f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": args.spec, "shape": args.shape, "dtype": args.dtype, "pass": args.kind,
                       "field": args.field, "calls": calls,
                       "values": {str(v): {"rounds_ms": rounds[v], "sync_ms": sync[v], "peak_gib": peak[v]}
                                  for v in values}}, f, indent=1)


if __name__ == "__main__":
    main()
