"""FLA's chunk op for one of recgen's built-ins, timed in its own process (run by ``recgen.bench``; torch and
MLX must not share a process: each keeps its own CUDA allocator). Standalone: it imports nothing of recgen.

    python fla_worker.py '{"op": "gla", "dtype": "bfloat16", "inputs": [[name, shape, law], ...],
                           "passes": ["fwd", "fwdbwd", "peak"], "do_shape": [B, T, H, V]}'

Prints one line: ``RESULT {kind: {"value": ..., "note": ..., "extra": {...}}, "info": {...}}`` or
``SKIP reason`` (torch, triton, fla or a CUDA device missing). Inputs are drawn with the laws of
``recgen.testing.input_law`` passed in the job. With ``"profile": true`` in the job it prints instead, for each
of the passes fwd and fwdbwd, torch.profiler's table of FLA's kernels over ``PROFILE_CALLS`` calls after warm-up
(``benchmarks/run_gpu.sh profile-fla:SPEC:SHAPE``: FLA's kernels beside recgen's ``profile``).
"""
import json
import os
import sys

# run as a script, this file's directory (recgen's modules) would shadow top-level names
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

PROFILE_CALLS = 10

# spec name -> (module, function); arguments in the spec's input order (FLA's own order for these four)
OPS = {"gated_delta_net": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
       "delta_net": ("fla.ops.delta_rule", "chunk_delta_rule"),
       "gla": ("fla.ops.gla", "chunk_gla"),
       "simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla")}


def skip(reason):
    print("SKIP " + reason, flush=True)
    sys.exit(0)


def draw(torch, law, shape):
    kind = law[0]
    if kind == "cubed":
        return law[1] * torch.rand(shape, device="cuda") ** 3
    if kind == "sigmoid":
        return torch.sigmoid(torch.randn(shape, device="cuda"))
    if kind == "normal":
        a = torch.randn(shape, device="cuda")
        return torch.nn.functional.normalize(a, dim=-1) if law[1] else a
    return law[3] * (law[1] + (law[2] - law[1]) * torch.rand(shape, device="cuda"))


def main(job):
    import importlib

    try:
        import torch
    except ImportError:
        skip("torch is not installed")
    if not torch.cuda.is_available():
        skip("torch sees no CUDA device")
    try:
        import triton
        import triton.testing
    except ImportError:
        skip("triton is not installed")
    try:
        mod_name, fn_name = OPS[job["op"]]
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except KeyError:
        skip(f"FLA has no chunk op for {job['op']}")
    except ImportError as e:
        skip(f"fla (flash-linear-attention) is not importable: {e}")
    info = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        from importlib.metadata import version
        info["fla"] = version("flash-linear-attention")
    except Exception:  # noqa: BLE001 - a version string is informative only
        pass
    try:  # FLA #640: the gated chunk backward is refused on Hopper with Triton < 3.7.1; run it for timing
        import fla.ops.common.chunk_o as chunk_o
        if getattr(chunk_o, "IS_NVIDIA_HOPPER", False):
            chunk_o.IS_NVIDIA_HOPPER = False
            info["hopper_guard_off"] = True
    except ImportError:
        pass

    torch.manual_seed(0)
    dtype = getattr(torch, job["dtype"])
    xs = [draw(torch, law, tuple(shape)).to(dtype).requires_grad_() for _, shape, law in job["inputs"]]
    do = torch.randn(job["do_shape"], device="cuda").to(dtype)
    passes = job["passes"]

    def fwd():
        with torch.no_grad():
            return fn(*xs)[0]

    def fwdbwd():
        for x in xs:
            x.grad = None
        fn(*xs)[0].backward(do)

    def peak(f):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        f()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2 ** 30

    if job.get("profile"):
        profile(torch, {k: f for k, f in (("fwd", fwd), ("fwdbwd", fwdbwd)) if k in passes})
        return
    out = {}
    for kind, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        if kind not in passes and passes != ["peak"]:
            continue
        try:
            if kind in passes:
                out[kind] = {"value": triton.testing.do_bench(f, return_mode="median")}
            if "peak" in passes:
                out["peak_" + kind] = {"value": peak(f)}
        except Exception as e:  # noqa: BLE001 - one failing pass is reported, the others still run
            note = f"FLA failed: {type(e).__name__}: {str(e)[:200]}"
            for k in ([kind] if kind in passes else []) + (["peak_" + kind] if "peak" in passes else []):
                out.setdefault(k, {"value": None, "note": note})
    out["info"] = info
    print("RESULT " + json.dumps(out), flush=True)


def profile(torch, calls):
    """Each call of ``calls`` (pass -> function) warmed up (Triton's autotuning), then ``PROFILE_CALLS`` times under
    torch.profiler: the table of its GPU kernels by total time."""
    for kind, f in calls.items():
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_CALLS):
                f()
            torch.cuda.synchronize()
        print(f"=== FLA {kind}, {PROFILE_CALLS} calls", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=50), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
