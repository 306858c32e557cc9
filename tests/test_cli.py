"""The command line: ``recgen list`` and ``recgen show SPEC``; user errors exit 2 without a traceback."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from recgen import cli

from recgen.spec import ir
from recgen.spec.resolve import resolve_spec
from recgen.specs import BUILTINS

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*argv, cwd=None, monkeypatch=None):
    out, err = io.StringIO(), io.StringIO()
    if cwd is not None:
        monkeypatch.chdir(cwd)
    code = cli.main(list(argv), console=Console(file=out, width=200, color_system=None),
                    err_console=Console(file=err, width=200, color_system=None))
    return code, out.getvalue(), err.getvalue()


def test_list_all_builtins():
    code, out, err = run_cli("list")
    assert code == 0 and not err
    for name, rec in BUILTINS.items():
        assert name in out
        assert cli.first_line(rec.doc)[:30] in out


def test_show_builtin_prints_ir_and_adjoint():
    code, out, err = run_cli("show", "gated_delta_net")
    assert code == 0 and not err
    rec = BUILTINS["gated_delta_net"]
    assert "Adjoint of gated_delta_net" in out
    assert "dbeta += d[a] * (-k)" in out and "dg += d[decay] * (exp(g))" in out
    assert f"Recurrence gated_delta_net [{rec.spec_hash()}]" in out


@pytest.mark.parametrize("name", list(BUILTINS))
def test_show_every_builtin(name):
    code, out, _ = run_cli("show", name)
    assert code == 0 and f"Adjoint of {name}" in out


def test_show_example_file(monkeypatch):
    code, out, err = run_cli("show", "examples/retnet.py:retnet", cwd=ROOT, monkeypatch=monkeypatch)
    assert code == 0, err
    assert "Recurrence retnet" in out and "dlog_gamma += d[decay] * (exp(log_gamma))" in out


@pytest.mark.parametrize("example,builtin", [("retnet", "retnet"), ("mlstm", "mlstm_sigmoid")])
def test_resolve_examples(example, builtin):
    """The examples' specs are the built-ins (moved there), still resolvable by path."""
    rec = resolve_spec(f"{ROOT}/examples/{example}.py:{example}")
    assert isinstance(rec, ir.Recurrence) and rec is BUILTINS[builtin]


def test_resolve_builtin_is_the_object():
    assert resolve_spec("gla") is BUILTINS["gla"]


@pytest.mark.parametrize("spec,fragment", [
    ("not_a_model", "unknown spec 'not_a_model'"),
    ("examples/nope.py:retnet", "not found"),
    ("examples/retnet.py:nope", "no attribute 'nope'"),
    ("examples/retnet.py:retnet_loop", "not a recurrence"),
    ("examples/retnet.py", "name the recurrence"),
    ("examples:retnet", "not a file"),
])
def test_bad_spec_exit_2(spec, fragment, monkeypatch):
    code, out, err = run_cli("show", spec, cwd=ROOT, monkeypatch=monkeypatch)
    assert code == 2
    assert fragment in err, err
    assert "Traceback" not in err and not out


def test_spec_error_in_user_file(tmp_path, monkeypatch):
    f = tmp_path / "bad_spec.py"
    f.write_text("from recgen import Key, Value, Step, outer, recurrence\n"
                 "@recurrence\n"
                 "def bad(q: Key, k: Key, v: Value):\n"
                 "    return Step(update=outer(k, v), readout=v)\n")
    code, out, err = run_cli("show", f"{f}:bad")
    assert code == 2 and "SpecError" in err and "readout r" in err and "Traceback" not in err


def test_syntax_error_in_user_file(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("def (:\n")
    code, _, err = run_cli("show", f"{f}:x")
    assert code == 2 and "SyntaxError" in err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == 2


def test_registry_is_extensible(monkeypatch):
    """emit/check plug in as one entry of COMMANDS."""
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    seen = {}

    def add(p):
        p.add_argument("spec")

    def handler(args, console):
        seen["rec"] = resolve_spec(args.spec)
        console.print("emitted")
        return 0

    cli.register("emit", "emit kernels", add, handler)
    code, out, _ = run_cli("emit", "gla")
    assert code == 0 and "emitted" in out and seen["rec"] is BUILTINS["gla"]


def test_module_entry_point_subprocess():
    res = subprocess.run([sys.executable, "-m", "recgen.cli", "show", "no_such_spec"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "unknown spec" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, "-m", "recgen.cli", "list"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0 and "power_retention" in res.stdout


@pytest.mark.parametrize("example", ["retnet", "mlstm", "hgrn2"])
def test_example_main_runs(example):
    res = subprocess.run([sys.executable, f"examples/{example}.py"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_emit_writes_kernels_and_manifest(tmp_path):
    from recgen.cli import main

    rc = main(["emit", "gla", "--target", "cuda", "-o", str(tmp_path), "--sizes", "K=16,V=16,H=2,HK=2"])
    assert rc == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "gla.cuda.manifest.json" in names and "recgen_gla_fwd_cuda_float32.cu" in names


def test_emit_and_check_user_errors(tmp_path, capsys):
    from recgen.cli import main

    assert main(["emit", "gla", "-o", str(tmp_path)]) == 2                      # no target
    assert main(["emit", "gla", "--target", "metal", "--sizes", "K=x"]) == 2    # bad sizes
    assert main(["check", "gla", "--sizes", "K=0"]) == 2                         # bad sizes
    err = capsys.readouterr().err
    assert "--target" in err and "--sizes" in err


def test_check_runs_metal_verification(capsys):
    from recgen.cli import main
    from recgen.verify.typecheck import clang_problem

    if clang_problem():
        pytest.skip(clang_problem())
    assert main(["check", "simple_gla", "--sizes", "K=8,V=8,H=2,HK=1", "--T", "3"]) == 0
    assert "all layers passed" in capsys.readouterr().out
