"""How the command-line scripts end: on bad input one ``error: ...`` line on stderr and exit status 2, as argparse
does for a bad flag, instead of a Python traceback; on Ctrl-C one ``interrupted`` line and status 130 (the shell's
128 + SIGINT). tokenmaxx's own warnings print as one ``warning: ...`` line. ``--debug`` (anywhere on the command
line) or ``TOKENMAXX_DEBUG=1`` shows the traceback instead.

    if __name__ == "__main__":
        sys.exit(run_script(main))
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Callable

DEBUG_FLAG = "--debug"
DEBUG_ENV = "TOKENMAXX_DEBUG"
# What bad input raises in tokenmaxx: bad values (ValueError, and BackboneMismatchError / DeepSpeedConfigError below
# it), missing files (FileNotFoundError), the Hub out of reach or refusing (ConnectionError / PermissionError); and
# transformers' OSError for a backbone that is neither a local folder nor a Hub repo it can reach.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ConnectionError, PermissionError, OSError)
INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


def flag_parser(dataclass_type, description: str | None = None):
    """The ``HfArgumentParser`` of a script's dataclass, with one fix to its help: a bool flag that defaults to true
    gets a ``--no_X`` twin, which transformers gives X's own help and "(default: False)"; here it says what it does."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_type, description=description)
    for action in parser._actions:
        negative = next((o for o in action.option_strings if o.startswith("--no_")), None)
        if negative is not None and isinstance(action, argparse._StoreFalseAction):
            action.help = f"the same as --{action.dest} false"
            action.default = argparse.SUPPRESS  # (the dataclass's default stands; no "(default: ...)" in the help)
    return parser


def parse_flags(dataclass_type, argv: list[str] | None, description: str | None = None):
    """The dataclass a script parses (``HfArgumentParser``). A flag argparse cannot parse ends the argparse way (usage,
    then its error); a value the dataclass's ``__post_init__`` refuses ends in one ``error:`` line and status 2, the
    way ``run_script`` ends any other bad input (the flags were well formed: a usage block would only bury the
    reason)."""
    parser = flag_parser(dataclass_type, description)
    try:
        (args,) = parser.parse_args_into_dataclasses(argv)
    except ValueError as err:
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        parser.exit(2, f"error: {message}\n")
    return args


def debugging(argv: list[str]) -> bool:
    """Whether the command line (or the environment) asks for tracebacks."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def interrupted(note: str | None = None) -> int:
    """After Ctrl-C: one line on stderr (on a line of its own: a streamed text may have been cut mid-line), with the
    script's ``INTERRUPTED_NOTE`` (what was kept, how to go on) where it has one, and the status 130 to exit with."""
    print("\ninterrupted (Ctrl-C)" + (f": {note}" if note else ""), file=sys.stderr, flush=True)
    return INTERRUPTED


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """tokenmaxx's own warnings as one ``warning: ...`` line (they are written for the reader, not the developer);
    others as Python shows them."""
    if getattr(category, "__module__", "").startswith("tokenmaxx"):
        return f"warning: {message}\n"
    return _python_format(message, category, filename, lineno, line)


_python_format = warnings.formatwarning


def run_script(main: Callable[[list[str]], object], argv: list[str] | None = None) -> int:
    """Run a script's ``main(argv)``: bad input ends in one ``error:`` line and status 2, Ctrl-C in one line and
    status 130 (``--debug``: the traceback); tokenmaxx's warnings print as one ``warning:`` line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debugging(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    saved, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        code = main(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        return interrupted(getattr(sys.modules.get(main.__module__), "INTERRUPTED_NOTE", None))
    except USER_ERRORS as err:
        if debug:
            raise
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())  # one line, always
        print(f"error: {message or type(err).__name__}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = saved
    return code if isinstance(code, int) else 0
