"""recgen's errors, in one module: each says what is wrong and names the term or argument."""


class SpecError(ValueError):
    """A malformed recurrence: the message names the offending term and why."""


class InputError(ValueError):
    """A call with wrong shapes, dtypes, values or sizes; the message names the argument."""


class UnsupportedKernel(NotImplementedError):
    """The spec has a term the generated kernels do not cover yet; the message says which."""


class CliError(Exception):
    """A user error the CLI reports in one line (exit code 2)."""
