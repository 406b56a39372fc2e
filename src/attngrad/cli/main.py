"""The ``attngrad`` command: a thin layer over the library.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int``.

Whatever goes wrong, the command prints one line on stderr and exits 2 for a bad option
(ValueError, TypeError: the library refusing what it was given) or 1 for a run that failed
(OSError, MemoryError, a missing optional dependency, ...): never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

# Subcommand modules, in the order --help lists them.
COMMANDS = ["check", "train", "tokenize", "bench", "derive", "graph", "sample", "export", "report", "ring",
            "conform", "grade"]

BAD_USAGE, FAILED = 2, 1


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit 2, no usage dump, no traceback."""

    def error(self, message):
        self.exit(BAD_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attngrad",
        description="Closed-form gradients of Transformer attention, proved against autograd.",
    )
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"attngrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _stdout_gone() -> None:
    """stdout cannot be written (a closed pipe, a full disk): point it at /dev/null so that
    the interpreter's final flush cannot fail again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor
        pass


def _describe_os_error(exc: OSError) -> str:
    what = exc.strerror or type(exc).__name__
    where = f": {exc.filename}" if exc.filename else ""
    return f"{what}{where}"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    name = f"attngrad {args.command}"
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except (BrokenPipeError, ConnectionResetError):  # `attngrad derive | head`: not an error of ours
        _stdout_gone()
        return FAILED
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError) as exc:
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return BAD_USAGE
    except MemoryError as exc:
        detail = f" ({_one_line(exc)})" if str(exc) else ""
        print(f"{name}: error: out of memory{detail}; try smaller sizes", file=sys.stderr)
        return FAILED
    except ImportError as exc:
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return FAILED
    except OSError as exc:
        if _is_stdout_error(exc):
            _stdout_gone()
            print(f"{name}: error: cannot write the output: {_describe_os_error(exc)}", file=sys.stderr)
        else:
            print(f"{name}: error: {_describe_os_error(exc)}", file=sys.stderr)
        return FAILED
    except (RuntimeError, FloatingPointError) as exc:
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return FAILED


def _is_stdout_error(exc: OSError) -> bool:
    """An OSError without a file name of the kinds that writing stdout gives (a full disk,
    a closed pipe, a bad descriptor): the command's output could not be written."""
    return not exc.filename and exc.errno in _STDOUT_ERRNOS


_STDOUT_ERRNOS = {errno.ENOSPC, errno.EPIPE, errno.EIO, errno.EBADF, errno.EDQUOT, errno.EFBIG}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
