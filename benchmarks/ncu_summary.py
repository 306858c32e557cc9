"""Per-kernel times per forward from an ``ncu --print-summary per-kernel`` log (benchmarks/ncu_chunked.sh):
    python benchmarks/ncu_summary.py LOG [FORWARDS]
FORWARDS (default 4: one warm-up and three timed calls) divides each kernel's total; kernels are listed by
their share, longest first, names cut to 110 characters."""
import re
import sys


def main():
    text = open(sys.argv[1]).read()
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    rows, name, inv = [], None, None
    for line in text.splitlines():
        m = re.match(r"\s{2}(\S.*?)\s+\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\).*Invocations (\d+)", line)
        if m:
            name, inv = m.group(1), int(m.group(2))
            continue
        m = re.search(r"gpu__time_duration.sum\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", line)
        if m and name:
            unit, _, _, avg = m.groups()
            rows.append((float(avg) * {"ms": 1e3, "us": 1, "ns": 1e-3}[unit] * inv, inv, name[:110]))
            name = None
    rows.sort(reverse=True)
    print(f"total {sum(r[0] for r in rows) / calls:.0f} us per forward (sum / {calls})")
    for t, n, nm in rows[:40]:
        print(f"{t / calls:8.1f} us  x{n / calls:5.2f}  {nm}")


if __name__ == "__main__":
    main()
