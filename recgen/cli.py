"""The ``recgen`` command line: inspect built-in and user recurrences.

    recgen list                          the built-in specs, one line each
    recgen show SPEC                     the IR and its adjoint
    recgen bench SPEC [--shape B,T,H,D]  forward, forward+backward, peak memory (chained calls)
    SPEC := built-in name | path/to/file.py:function

Subcommands are registered in ``COMMANDS`` (name -> (help, add_arguments, handler)); adding
``emit`` or ``check`` is one entry: ``register("emit", "help", add_args, handler)``. A handler gets the
parsed ``argparse.Namespace`` and the ``rich`` console and returns an exit code. User errors
(malformed specs, bad inputs, missing files) are printed to stderr without a traceback, exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .version import __version__
from .errors import CliError, InputError, SpecError, UnsupportedKernel
from .spec.resolve import builtin_specs, resolve_spec
from .cli_bench import add_bench, cmd_bench
from .cli_kernels import add_check, add_emit, cmd_check, cmd_emit

# errors a user causes (a bad spec, bad input, a missing or broken file): one line, no traceback
USER_ERRORS: tuple[type[BaseException], ...] = (SpecError, InputError, OSError, ImportError, SyntaxError,
                                               UnsupportedKernel, ValueError)


def first_line(doc: str) -> str:
    for line in (doc or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


# -- subcommands ----------------------------------------------------------------------------------

def _cmd_list(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="built-in recurrences", show_lines=False)
    table.add_column("name", style="bold cyan", no_wrap=True)
    table.add_column("description")
    for name, rec in builtin_specs().items():
        table.add_row(name, Text(first_line(rec.doc)))
    console.print(table)
    return 0


def _add_show(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="built-in name or path/to/file.py:function")


def _cmd_show(args: argparse.Namespace, console: Console) -> int:
    from .math.adjoint import derive
    rec = resolve_spec(args.spec)
    ad = derive(rec)
    console.print(Panel(Text(rec.doc.strip() or "(no docstring)"), title=f"[bold]{rec.name}[/]",
                        subtitle=f"spec hash {rec.spec_hash()}", expand=False))
    console.print(Panel(Text(repr(rec)), title="IR", expand=False))
    console.print(Panel(Text(repr(ad)), title="adjoint", expand=False))
    return 0


Handler = Callable[[argparse.Namespace, Console], int]

# name -> (help, add_arguments(subparser), handler). Register ``emit`` / ``check`` here.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Handler]] = {
    "list": ("list the built-in recurrences", lambda p: None, _cmd_list),
    "show": ("show a recurrence's IR and its adjoint", _add_show, _cmd_show),
    "emit": ("write standalone kernels, their MLX form and a manifest", add_emit, cmd_emit),
    "check": ("verify the Metal kernels on this machine (capture, type check, limits, CPU run)", add_check, cmd_check),
    "bench": ("time a recurrence's forward, forward+backward and peak memory on this device", add_bench, cmd_bench),
}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             handler: Handler) -> None:
    """Add a subcommand (used for ``emit`` and ``check``)."""
    COMMANDS[name] = (help, add_arguments, handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recgen", description=first_line(__doc__))
    parser.add_argument("--version", action="version", version=f"recgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_, description=help_))
    return parser


def main(argv: list[str] | None = None, *, console: Console | None = None,
         err_console: Console | None = None) -> int:
    """Entry point; returns (and as a script exits with) the exit code."""
    console = console or Console()
    err_console = err_console or Console(stderr=True)
    args = build_parser().parse_args(argv)  # argparse exits 2 on usage errors
    handler = COMMANDS[args.command][2]
    try:
        return handler(args, console)
    except (CliError, *USER_ERRORS) as e:
        msg = str(e)
        kind = "error" if isinstance(e, CliError) else type(e).__name__
        err_console.print(Text(f"recgen {args.command}: {kind}: {msg}", style="bold red"))
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
