"""Parse and rewrite MSL source so that a C++ compiler (clang) can read it.

Both the type checker (`typecheck.py`, via the address-space shim) and the CPU
emulator (`cpu_exec.py`) feed MSL to clang++.  MSL is almost C++14 plus a few
constructs clang rejects; this module holds the small, explicit set of text
rewrites that bridge the gap, and a parser for kernel signatures (which the
emulator needs to bind buffers and thread attributes).

Accepted input forms:
  * MLX-wrapped source (see `capture.wrapped_source`): ``[[kernel]] void f(...)``,
    optionally a template with a ``template [[host_name("f")]] [[kernel]]
    decltype(f<...>) f<...>;`` explicit instantiation.
  * Standalone Metal files: ``kernel void f(...)`` with ``#include <metal_stdlib>``
    and ``[[threadgroup(n)]]`` parameters.
"""
from __future__ import annotations

import dataclasses
import re

# Thread-position attributes MLX may inject, with their MLX parameter types.
ATTRIBUTE_TYPES = {
    "dispatch_quadgroups_per_threadgroup": "uint",
    "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3",
    "grid_origin": "uint3",
    "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint",
    "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint",
    "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}

_QUALIFIERS = {"const", "volatile", "device", "constant", "threadgroup", "thread"}


@dataclasses.dataclass
class Param:
    """One kernel parameter: `decl` is the text before the name (e.g. ``const device float*``)."""

    decl: str
    name: str
    attr: str  # "buffer", "threadgroup" or a thread-attribute name
    index: int | None  # buffer / threadgroup slot, None for thread attributes

    @property
    def is_ref(self) -> bool:
        return self.decl.rstrip().endswith("&")

    @property
    def is_pointer(self) -> bool:
        return self.decl.rstrip().endswith("*")

    @property
    def is_const(self) -> bool:
        return "const" in self.decl.split()

    @property
    def element_type(self) -> str:
        """Base element type with qualifiers, `*`/`&` and `atomic<...>` removed."""
        t = self.decl.replace("*", " ").replace("&", " ")
        m = re.search(r"atomic\s*<\s*([\w:]+)\s*>", t)
        if m:
            return m.group(1)
        words = [w for w in t.split() if w not in _QUALIFIERS]
        return " ".join(words)


@dataclasses.dataclass
class Kernel:
    """A kernel found in the source; `call` is the expression the launcher calls."""

    name: str  # host name (what Metal would look up)
    function: str  # C++ function name
    call: str  # e.g. ``f<float, 4, 1>`` or ``f``
    params: list[Param]


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([<{":
            depth += 1
        elif ch in ")]>}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def _parse_param(text: str) -> Param:
    text = " ".join(text.split())
    m = re.match(r"^(.*?)\s*\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]\s*$", text)
    if not m:
        raise ValueError(f"kernel parameter without an attribute: {text!r}")
    decl_name, attr, idx = m.group(1), m.group(2), m.group(3)
    nm = re.match(r"^(.*?)(\w+)\s*$", decl_name)
    if not nm:
        raise ValueError(f"cannot parse kernel parameter {text!r}")
    return Param(nm.group(1).strip(), nm.group(2), attr, int(idx) if idx is not None else None)


def _matching_paren(src: str, open_pos: int) -> int:
    depth = 0
    for i in range(open_pos, len(src)):
        if src[i] == "(":
            depth += 1
        elif src[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced parentheses in kernel signature")


_KERNEL_RE = re.compile(r"(?:\[\[\s*kernel\s*\]\]|\bkernel\b)\s+void\s+(\w+)\s*\(")
_INST_RE = re.compile(
    r"template\s*\[\[\s*host_name\(\s*\"([^\"]+)\"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*"
    r"decltype\(\s*(\w+)\s*(<[^;]*?>)\s*\)\s*\w+\s*<[^;]*?>\s*;"
)


def find_kernels(src: str) -> list[Kernel]:
    """All kernels in `src`; a template kernel yields one entry per explicit instantiation."""
    src = strip_comments(src)
    insts = _INST_RE.findall(src)
    kernels = []
    for m in _KERNEL_RE.finditer(src):
        if src[max(0, m.start() - 9):m.start()].strip().endswith("template"):
            continue  # this is the instantiation line itself
        fn = m.group(1)
        close = _matching_paren(src, m.end() - 1)
        params = [_parse_param(p) for p in _split_top_level(src[m.end():close])]
        mine = [(h, f, a) for h, f, a in insts if f == fn]
        if mine:
            kernels += [Kernel(h, fn, f"{fn}{' '.join(a.split())}", params) for h, f, a in mine]
        else:
            kernels.append(Kernel(fn, fn, fn, params))
    return kernels


def pick_kernel(src: str, kernel_name: str | None) -> Kernel:
    """The kernel named `kernel_name` (host or function name, or an MLX `custom_kernel_<name>` prefix)."""
    ks = find_kernels(src)
    if not ks:
        raise ValueError("no kernel function found in source")
    if kernel_name is None:
        if len(ks) != 1:
            raise ValueError(f"several kernels, pass kernel_name: {[k.name for k in ks]}")
        return ks[0]
    for pred in (lambda k: k.name == kernel_name, lambda k: k.function == kernel_name,
                 lambda k: k.name.startswith(f"custom_kernel_{kernel_name}_")):
        hits = [k for k in ks if pred(k)]
        if len(hits) == 1:
            return hits[0]
    raise ValueError(f"kernel {kernel_name!r} not found; have {[k.name for k in ks]}")


def strip_comments(src: str) -> str:
    """Remove // and /* */ comments (keeping line structure) so regexes only see code."""
    src = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def rewrite_for_clang(src: str) -> str:
    """Apply the rewrites clang needs; line count is preserved so diagnostics map back 1:1.

    1. drop ``#include <metal_*>`` (the shim / runtime header replaces them);
    2. ``template [[host_name("x")]] [[kernel]] decltype(...)`` -> ``template decltype(...)``
       (clang: "an attribute list cannot appear here");
    3. kernel-scope ``threadgroup T a[N];`` -> ``static threadgroup T a[N];`` (clang: automatic
       variable with an address space; on the CPU a static local *is* per-threadgroup memory
       because threadgroups run one after another);
    4. program-scope ``constant T x = v;`` -> ``static const constant T x = v;`` (usable as an
       array bound, as in MSL);
    5. ``[[threadgroup(n)]]`` -> ``[[tg_slot(n)]]`` (``threadgroup`` is a macro in our headers);
    6. half literals ``1.0h`` -> ``half(1.0)``.
    """
    src = re.sub(r"(?m)^[ \t]*#\s*include\s*<metal_\w+>[^\n]*$", "", src)
    src = re.sub(r"template\s*\[\[\s*host_name\([^)]*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*", "template ", src)
    src = re.sub(r"(?m)^([ \t]*)(threadgroup\s+[^;*&=(]*?\w+\s*(?:\[[^\]]*\]\s*)*;)", r"\1static \2", src)
    src = re.sub(r"(?m)^constant\s+", "static const constant ", src)
    src = re.sub(r"\[\[\s*threadgroup\s*\(", "[[tg_slot(", src)
    src = re.sub(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?[hH]\b", r"half(\1\2)", src)
    return src


def threadgroup_arrays(src: str) -> list[tuple[str, str, str]]:
    """Kernel-scope ``threadgroup T name[dims];`` declarations as (type, name, dims-text)."""
    out = []
    for m in re.finditer(r"(?m)^[ \t]*(?:static\s+)?threadgroup\s+([^;*&=(]*?)\s*(\w+)\s*((?:\[[^\]]*\]\s*)+);",
                         strip_comments(src)):
        out.append((" ".join(m.group(1).split()), m.group(2), m.group(3).strip()))
    return out
