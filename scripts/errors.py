"""How the command-line scripts end on bad input: one ``error: ...`` line on stderr and exit status 2, as argparse
does for a bad flag, instead of a Python traceback. ``--debug`` (anywhere on the command line) or
``TOKENMAXX_DEBUG=1`` shows the traceback instead.

    if __name__ == "__main__":
        sys.exit(run_script(main))
"""

from __future__ import annotations

import os
import sys
from typing import Callable

DEBUG_FLAG = "--debug"
DEBUG_ENV = "TOKENMAXX_DEBUG"
# What bad input raises in tokenmaxx: bad values (ValueError, and BackboneMismatchError / DeepSpeedConfigError below
# it), missing files (FileNotFoundError), the Hub out of reach or refusing (ConnectionError / PermissionError); and
# transformers' OSError for a backbone that is neither a local folder nor a Hub repo it can reach.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ConnectionError, PermissionError, OSError)


def parse_flags(dataclass_type, argv: list[str] | None, description: str | None = None):
    """The dataclass a script parses (``HfArgumentParser``). A flag argparse cannot parse ends the argparse way (usage,
    then its error); a value the dataclass's ``__post_init__`` refuses ends in one ``error:`` line and status 2, the
    way ``run_script`` ends any other bad input (the flags were well formed: a usage block would only bury the
    reason)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_type, description=description)
    try:
        (args,) = parser.parse_args_into_dataclasses(argv)
    except ValueError as err:
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        parser.exit(2, f"error: {message}\n")
    return args


def run_script(main: Callable[[list[str]], object], argv: list[str] | None = None) -> int:
    """Run a script's ``main(argv)``; bad input ends in one ``error:`` line and status 2 (``--debug``: traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        code = main(argv)
    except USER_ERRORS as err:
        if debug:
            raise
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())  # one line, always
        print(f"error: {message or type(err).__name__}", file=sys.stderr)
        return 2
    return code if isinstance(code, int) else 0
