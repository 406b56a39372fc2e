"""``FILE.py:fn``: a learner's function, read from a Python file (``attngrad grade``)."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

from .runner import FunctionFailed


def load_function(target: str):
    """The function ``fn`` of the Python file ``FILE.py`` named by ``"FILE.py:fn"``.

    ValueError for a target of another form, a file that does not exist or a name the file
    does not define as a function; :class:`FunctionFailed` if running the file raises (a
    syntax error, an import that fails, ...).  The file's folder is on ``sys.path`` while it
    runs, so that it can import its neighbours.
    """
    if not isinstance(target, str):
        raise TypeError(f"target must be a string 'FILE.py:fn'; got {type(target).__name__}")
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise ValueError(f"expected FILE.py:fn (a Python file and the name of a function in it); got {target!r}")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"{path_text}: no such file (expected FILE.py:fn)")
    module_name = f"_attngrad_graded_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path_text}: not a Python file (expected FILE.py:fn)")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[module_name] = module  # (dataclasses and pickling look the module up)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(module_name, None)
        raise FunctionFailed(f"running {path_text} raised {type(exc).__name__}: {exc}{_line(exc, path)}") from exc
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        what = "has no function" if fn is None else f"has {name!r} of type {type(fn).__name__}, not a function"
        if fn is None:
            what += f" named {name!r}"
        raise ValueError(f"{path_text} {what}; its functions: {', '.join(defined) or 'none'}")
    return fn


def _line(exc: Exception, path: Path) -> str:
    """' (line n)' of the error in the learner's file, where the traceback or the
    SyntaxError says it."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return ""  # its message already says "(FILE, line n)"
    here = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f" (line {here[-1].lineno})" if here else ""
