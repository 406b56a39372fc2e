"""``attngrad train --preset NAME --config FILE.toml``: options from a named preset and a
TOML file, under the command line.

Precedence: the command line, then the TOML file, then the preset, then the defaults.
The file is flat: ``key = value`` per option, the key an option's name with or without its
dashes (``batch-size = 32``, ``batch_size = 32``, ``no-plots = true``, ``plots = false``),
and the optimizer's fields (``beta1``, ``beta2``, ``eps``, ``min_lr_ratio``) besides; a
``preset = "char"`` line picks a preset when the command line names none.  Each value
goes through the option's own parser, so a bad one is refused as on the command line.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..train.config import flat_fields
from ..train.presets import preset as get_preset
from . import train_dp

# (dest, value) of the options that are None when not given, and their real defaults
DEFAULTS = {"threads": None, "plots": True, "quiet": False, "tensorboard": False, **train_dp.DEFAULTS}
_NOT_FROM_FILE = ("help", "config", "_parser", "distributed")


def _actions(parser) -> dict:
    """name -> action: each option's dest and flag spelled with underscores."""
    out = {}
    for a in parser._actions:
        if not a.option_strings or a.dest in _NOT_FROM_FILE:
            continue
        out[a.dest] = a
        for flag in a.option_strings:
            if flag.startswith("--"):
                out[flag[2:].replace("-", "_")] = a
    return out


def _value(a, key: str, v, where: str):
    """The TOML value ``v`` of option ``a`` as the command line's parser makes it."""
    if isinstance(v, dict | list):
        raise ValueError(f"{where}: {key} must be a single value; got {type(v).__name__}")
    if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(v, bool):
            raise ValueError(f"{where}: {key} must be true or false; got {v!r}")
        flag_key = key in (a.dest,)  # `plots = false` names the value; `no-plots = true` the flag
        return v if flag_key else (a.const if v else (not a.const))
    if isinstance(v, bool):
        raise ValueError(f"{where}: {key} expects a value, not {str(v).lower()}")
    if a.nargs == "?" and v is True:
        return a.const
    text = repr(v) if isinstance(v, float) else str(v)
    try:
        out = a.type(text) if a.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {key}: {exc}") from None
    if a.choices is not None and out not in a.choices:
        raise ValueError(f"{where}: {key}: {out!r} is not one of {sorted(a.choices)}")
    return out


def read_config(path, parser) -> dict:
    """dest -> value of the options in TOML file ``path`` (ValueError naming the file and
    the key on anything wrong)."""
    import tomllib

    p = Path(path)
    try:
        with open(p, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config: no such file: {p}") from None
    except IsADirectoryError:
        raise ValueError(f"--config: {p} is a folder; expected a TOML file") from None
    except OSError as exc:
        raise ValueError(f"--config: cannot read {p}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config: {p} is not valid TOML: {exc}") from None
    where = f"--config {p}"
    actions = _actions(parser)
    extra = set(flat_fields())  # the optimizer's fields have no flag
    out = {}
    for key, v in table.items():
        name = key.replace("-", "_")
        if name == "preset":
            out["preset"] = _value(actions["preset"], key, v, where)
        elif name in actions:
            out[actions[name].dest] = _value(actions[name], key, v, where)
        elif name in extra:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{where}: {key} must be a number; got {v!r}")
            out[name] = v
        else:
            known = sorted({a.dest for a in actions.values()} | extra)
            raise ValueError(f"{where}: unknown option {key!r}; expected one of {', '.join(known)}")
    return out


def apply(args) -> None:
    """Fill the options not given on the command line from --config, then --preset, then
    their defaults; --out must come from one of them."""
    parser = args._parser
    from_file = read_config(args.config, parser) if args.config else {}
    name = args.preset if args.preset is not None else from_file.get("preset")
    from_file.pop("preset", None)
    layers = [from_file, get_preset(name) if name else {}]
    if name:
        args.preset = name
    for layer in layers:
        for dest, v in layer.items():
            if getattr(args, dest, None) is None:
                setattr(args, dest, v)
    for dest, v in DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, v)
    if args.out is None:
        parser.error("the following arguments are required: --out (or out = \"DIR\" in --config)")
    args.out = Path(args.out)
