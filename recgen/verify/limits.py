"""Static lints for Apple-GPU limits that neither clang nor the CPU emulator enforce.

Why: a CPU happily runs 64 KB of "threadgroup memory" or 2048 threads per group; a Mac
refuses at pipeline creation.  These checks are cheap text checks on the (MLX-wrapped)
source plus the launch configuration.
"""
from __future__ import annotations

import ast
import dataclasses
import operator
import re

from .msl_source import strip_comments, threadgroup_arrays

MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_BYTES = 32 * 1024
MAX_BUFFERS = 31

TYPE_SIZES = {
    "float": 4, "int": 4, "uint": 4, "int32_t": 4, "uint32_t": 4, "unsigned int": 4, "atomic_int": 4,
    "atomic_uint": 4, "atomic<float>": 4, "atomic<int>": 4, "atomic<uint>": 4,
    "half": 2, "float16_t": 2, "bfloat": 2, "bfloat16_t": 2, "short": 2, "ushort": 2, "int16_t": 2, "uint16_t": 2,
    "char": 1, "uchar": 1, "int8_t": 1, "uint8_t": 1, "bool": 1, "int64_t": 8, "uint64_t": 8, "long": 8,
    "ulong": 8, "double": 8, "float2": 8, "float3": 16, "float4": 16, "half2": 4, "half4": 8, "int2": 8, "int4": 16,
    "uint2": 8, "uint4": 16, "complex64_t": 8,
}


@dataclasses.dataclass
class LintIssue:
    rule: str  # "threads" | "threadgroup_memory" | "buffers" | "ascii" | "double" | "unknown_size"
    message: str
    line: int | None = None


def _template_args(src: str) -> dict[str, str]:
    """Template parameter -> argument, from MLX's ``template <...>`` + explicit instantiation."""
    code = strip_comments(src)
    decl = re.search(r"template\s*<([^>]*)>\s*\[\[\s*kernel\s*\]\]", code)
    inst = re.search(r"decltype\(\s*\w+\s*<([^>]*)>\s*\)", code)
    if not (decl and inst):
        return {}
    names = [p.split()[-1] for p in decl.group(1).split(",")]
    vals = [v.strip() for v in inst.group(1).split(",")]
    return dict(zip(names, vals))


def _constants(src: str) -> dict[str, str]:
    """Program-scope ``constant T NAME = value;`` and ``#define NAME value`` integer constants."""
    code = strip_comments(src)
    out = {m.group(1): m.group(2) for m in re.finditer(r"(?m)^\s*constant\s+[\w ]+?\s(\w+)\s*=\s*([^;]+);", code)}
    out.update({m.group(1): m.group(2) for m in re.finditer(r"(?m)^\s*#define\s+(\w+)\s+([^\n]+)$", code)})
    return out


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv, ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift}


def _eval_int(expr: str, env: dict[str, str], depth: int = 0) -> int | None:
    """Evaluate a small integer expression (+ - * / % << >>, names from env); None if unknown."""
    expr = re.sub(r"(\d+)[uUlL]+\b", r"\1", expr.strip())
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name) and n.id in env and depth < 8:
            return _eval_int(env[n.id], env, depth + 1)
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            a, b = ev(n.left), ev(n.right)
            return None if a is None or b is None else _OPS[type(n.op)](a, b)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            v = ev(n.operand)
            return None if v is None else -v
        return None

    return ev(tree)


def threadgroup_bytes(src: str, template: dict | None = None) -> tuple[int, list[str]]:
    """Total bytes of kernel-scope threadgroup arrays, and the declarations whose size is unknown."""
    env = {**_constants(src), **_template_args(src), **{k: str(v) for k, v in (template or {}).items()}}
    total, unknown = 0, []
    for ctype, name, dims in threadgroup_arrays(src):
        ctype = env.get(ctype, ctype)
        size = TYPE_SIZES.get(ctype.replace("metal::", ""))
        n = 1
        for d in re.findall(r"\[([^\]]*)\]", dims):
            v = _eval_int(d, env)
            n = None if v is None or n is None else n * v
        if size is None or n is None:
            unknown.append(f"threadgroup {ctype} {name}{dims}")
        else:
            total += size * n
    return total, unknown


def lint(source: str, threadgroup=None, *, threadgroup_memory_bytes: int | None = None,
         template: dict | None = None) -> list[LintIssue]:
    """All limit violations for `source` launched with `threadgroup` (a 1-3 tuple of threads).

    `threadgroup_memory_bytes` overrides the parsed total (e.g. for ``[[threadgroup(n)]]``
    parameters whose size is set by the host).
    """
    issues: list[LintIssue] = []
    if threadgroup is not None:
        dims = tuple(threadgroup) if hasattr(threadgroup, "__len__") else (threadgroup,)
        n = 1
        for d in dims:
            n *= int(d)
        if n > MAX_THREADS_PER_THREADGROUP:
            issues.append(LintIssue("threads", f"{n} threads per threadgroup > {MAX_THREADS_PER_THREADGROUP}"))
    total, unknown = threadgroup_bytes(source, template)
    if threadgroup_memory_bytes is not None:
        total, unknown = threadgroup_memory_bytes, []
    if total > MAX_THREADGROUP_BYTES:
        issues.append(LintIssue("threadgroup_memory", f"{total} bytes of threadgroup memory > {MAX_THREADGROUP_BYTES}"))
    for u in unknown:
        issues.append(LintIssue("unknown_size", f"cannot size {u!r}; pass template= or threadgroup_memory_bytes="))
    idx = [int(x) for x in re.findall(r"\[\[\s*buffer\s*\(\s*(\d+)\s*\)\s*\]\]", source)]
    if idx and max(idx) + 1 > MAX_BUFFERS:
        issues.append(LintIssue("buffers", f"{max(idx) + 1} buffers > {MAX_BUFFERS}"))
    for i, line in enumerate(source.splitlines(), 1):
        bad = [c for c in line if ord(c) > 127]
        if bad:
            issues.append(LintIssue("ascii", f"non-ASCII character {bad[0]!r} (MLX hands Metal ASCII)", i))
    for i, line in enumerate(strip_comments(source).splitlines(), 1):
        if re.search(r"\bdouble\b", line):
            issues.append(LintIssue("double", "Metal has no double (a float64 input/output or literal type)", i))
    return issues
