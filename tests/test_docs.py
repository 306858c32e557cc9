"""The users' documents stay documents for users: the README fits a screenful of sections (<= 10 KB) and keeps
the two commands CI runs; design decisions live in docs/design.md; no raw run log is kept in the tree; no file
names a path of one machine."""
from __future__ import annotations

import subprocess

from helpers import ROOT

COMMANDS = ('pip install -e ".[cpu]" && recgen emit gated_delta_net --all -o build && python examples/quickstart.py',
            'pip install -e ".[cpu,test]" && python -m pytest -n auto --dist loadgroup')


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10 * 1024
    for cmd in COMMANDS:
        assert cmd in text
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_design_notes_and_no_raw_logs():
    assert (ROOT / "docs" / "design.md").is_file()
    assert not [p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.suffix in (".log", ".txt")]


def test_no_absolute_machine_paths():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    bad = []
    for f in files:
        if f.endswith((".py", ".md", ".sh", ".toml", ".j2")) and f != "tests/test_docs.py":
            text = (ROOT / f).read_text(errors="replace")
            bad += [f for marker in ("/work/", "/root/", "/home/") if marker in text]
    assert bad == []
