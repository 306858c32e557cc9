"""Type-check MSL with `clang++ -fsyntax-only` and the address-space shim (`msl_shim.h`).

Why: it is the only GPU-free check that catches address-space, const and arity mistakes in
the exact source MLX compiles (docs/design.md, "Verifying Metal without a Mac").
It cannot see races, OOB or numerics -- that is `cpu_exec`'s job.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .msl_source import rewrite_for_clang, threadgroup_arrays

HERE = Path(__file__).resolve().parent
SHIM = HERE / "msl_shim.h"
MAX_THREADGROUP_BYTES = 32768
MAX_BUFFER_INDEX = 30


@dataclasses.dataclass
class Diagnostic:
    line: int
    column: int
    severity: str  # "error" | "warning" | "note"
    message: str


@dataclasses.dataclass
class CheckResult:
    ok: bool
    diagnostics: list[Diagnostic]
    output: str  # raw clang output
    command: list[str]

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    def __str__(self) -> str:
        return "ok" if self.ok else "\n".join(f"kernel.metal:{d.line}:{d.column}: {d.severity}: {d.message}"
                                              for d in self.errors)


MIN_CLANG = 15  # _Float16 on x86-64 (the shim's Metal half) and the emulator's C++20


def clang_version(path: str) -> tuple[int, ...] | None:
    """(major, minor, ...) of a clang++ executable, from ``--version``; None if it does not say."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"clang version (\d+(?:\.\d+)*)", out)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


@functools.lru_cache(maxsize=1)
def find_clang() -> str | None:
    """Newest clang++ on PATH with _Float16 support on x86 (>= 15): clang++-22 .. clang++-15, else a plain
    clang++ whose version is at least 15; None without one (``clang_problem`` says why)."""
    for v in range(22, MIN_CLANG - 1, -1):
        p = shutil.which(f"clang++-{v}")
        if p:
            return p
    p = shutil.which("clang++")
    return p if p and (clang_version(p) or (0,)) >= (MIN_CLANG,) else None


def clang_problem() -> str | None:
    """Why the Metal checks cannot run here (no clang++, or one older than 15), or None when they can."""
    if find_clang() is not None:
        return None
    p = shutil.which("clang++")
    if p is None:
        return f"Metal verification needs clang >= {MIN_CLANG} (clang++ not found; apt-get install clang-19)"
    v = clang_version(p)
    found = ".".join(map(str, v)) if v else "of unknown version"
    return (f"Metal verification needs clang >= {MIN_CLANG} for _Float16 (Metal's half); found clang++ {found} at "
            f"{p} (apt-get install clang-19)")


def _limit_asserts(src: str) -> str:
    """`static_assert`s for the static limits clang can evaluate (threadgroup bytes, buffer count)."""
    arrays = threadgroup_arrays(src)
    extra = []
    if arrays:
        total = " + ".join(f"sizeof({n})" for _, n, _ in arrays)
        extra.append(f'static_assert({total} <= {MAX_THREADGROUP_BYTES}, '
                     f'"threadgroup memory exceeds {MAX_THREADGROUP_BYTES} bytes");')
    return " ".join(extra)


def _insert_after_last_tg_decl(src: str, text: str) -> str:
    """Put the threadgroup static_assert right after the last kernel-scope threadgroup array."""
    if not text:
        return src
    matches = list(re.finditer(r"(?m)^[ \t]*static\s+threadgroup\s+[^;*&=(]*?\w+\s*(?:\[[^\]]*\]\s*)+;", src))
    if not matches:
        return src
    end = matches[-1].end()
    return src[:end] + " " + text + src[end:]


def typecheck(msl_source: str, clang: str | None = None, extra_flags: tuple[str, ...] = ()) -> CheckResult:
    """Run clang's front end on `msl_source` (MLX-wrapped or a standalone .metal file)."""
    clang = clang or find_clang()
    if clang is None:
        raise RuntimeError(clang_problem())
    body = rewrite_for_clang(msl_source)
    body = _insert_after_last_tg_decl(body, _limit_asserts(body))
    buf_ids = [int(x) for x in re.findall(r"\[\[\s*buffer\s*\(\s*(\d+)\s*\)\s*\]\]", msl_source)]
    if buf_ids and max(buf_ids) > MAX_BUFFER_INDEX:
        body += f'\nstatic_assert(false, "buffer index {max(buf_ids)} > {MAX_BUFFER_INDEX}");'
    text = f'#include "{SHIM}"\n#line 1 "kernel.metal"\n{body}\n'
    with tempfile.TemporaryDirectory(prefix="recgen_tc_") as tmp:
        path = os.path.join(tmp, "kernel.cpp")
        Path(path).write_text(text)
        cmd = [clang, "-fsyntax-only", "-std=c++17", "-fno-exceptions", "-fno-rtti", "-Wno-unknown-attributes",
               "-Wno-unused-value", "-ferror-limit=50", "-fno-color-diagnostics", *extra_flags, path]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = p.stderr + p.stdout
    diags = [Diagnostic(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))
             for m in re.finditer(r"^kernel\.metal:(\d+):(\d+): (error|warning|note): (.*)$", out, re.M)]
    if p.returncode != 0 and not any(d.severity == "error" for d in diags):
        diags.append(Diagnostic(0, 0, "error", out.strip()[-2000:] or f"clang exited {p.returncode}"))
    return CheckResult(p.returncode == 0, diags, out, cmd)
