"""Command-line parsing shared by every ``quartctl`` command and agent: bad input is one line and exit 2.

:class:`ArgumentParser` is argparse's, except that an error prints ``<prog>: error: <what> (see <prog>
--help)`` on one line (no usage block) and exits with 2, the code of a usage error; :func:`port` and
:func:`positive_int` are argument types that name what is wrong.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def usage_error(prog: str, message: str) -> int:
    """Print a one-line usage error for ``prog``; returns 2 (``return usage_error(...)``)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    return 2


def port(raw: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port must be an integer from 0 to 65535, got {raw!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be from 0 (any free port) to 65535, got {value}")
    return value


def positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value
