"""The package's layering, checked on its source: no module imports a layer above its own.

An AST walk over ``src/attngrad`` collects every import (inside functions too) and resolves
it to the top-level unit it reaches (a subpackage or a top-level module).  The rules:

- a unit imports only units at or below its own rank in LAYERS (its own unit included);
- nothing imports the command line (``cli``) except ``cli`` itself and ``__main__``;
- nothing imports the package ``attngrad/__init__.py`` (``import attngrad``, or
  ``from .. import name`` where ``name`` is not a submodule).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "attngrad"

# Low -> high: each unit may import the units before it, never one after it.  A strict
# order, so no two packages can import each other.
LAYERS = (
    "_version",  # the version string, read by the package init and the CLI
    "runtime",  # the CPU runtime: array checks, worker pool, workspace, BLAS, compiled kernels
    "resources",  # memory and time estimates against the machine
    "scores",  # score and mask functions as expressions: traced, derived, printed, evaluated
    "core",  # the attention maths
    "layers",
    "models",
    "jacobian",
    "distributed",  # ring attention and the process group it runs on
    "formulas",
    "check",
    "conform",
    "grade",  # attngrad grade: a learner's layer against the closed form
    "train",  # data-parallel training included
    "report",
    "bench",
    "torch",
    "jax",
    "transformers",  # the Hugging Face integration (on top of the torch drop-in)
    "cli",
    "__init__",  # the package's public names
    "__main__",
)
CLI_USERS = ("cli", "__main__")
PACKAGE_INIT = "__init__"


def _module_name(path: Path, root: Path) -> tuple[str, ...]:
    """('attngrad', 'core', 'sdpa') for root/core/sdpa.py; a package's __init__ is the package."""
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(root: Path, dotted: tuple[str, ...]) -> bool:
    """Whether ``dotted`` (starting with the root package's name) names a module or package."""
    rel = root.joinpath(*dotted[1:])
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def _targets(node, here: tuple[str, ...], is_pkg: bool, root: Path):
    """The modules of the root package that an import node reaches (dotted tuples)."""
    top = root.name
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = tuple(alias.name.split("."))
            if parts[0] == top:
                yield parts
        return
    if node.level:
        base = here if is_pkg else here[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        parts = base + (tuple(node.module.split(".")) if node.module else ())
    else:
        parts = tuple((node.module or "").split("."))
        if parts[0] != top:
            return
    for alias in node.names:
        sub = (*parts, alias.name)
        yield sub if _is_module(root, sub) else parts  # a submodule, or a name of `parts`


def _unit(dotted: tuple[str, ...]) -> str:
    """The top-level unit of a module: 'core' for attngrad.core.sdpa; '__init__' for attngrad."""
    return dotted[1] if len(dotted) > 1 else PACKAGE_INIT


def upward_imports(root: Path, layers=LAYERS) -> list[str]:
    """Every import that breaks the rules, as 'file:line: unit -> unit (why)'."""
    rank = {name: i for i, name in enumerate(layers)}
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = _module_name(path, root)
        is_pkg = path.name == "__init__.py"
        src_unit = _unit(here)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, here, is_pkg, root):
                dst_unit = _unit(target)
                where = f"{path.relative_to(root.parent)}:{node.lineno}: {src_unit} -> {'.'.join(target)}"
                if dst_unit == src_unit and target != (root.name,):
                    continue
                if target == (root.name,):
                    bad.append(f"{where} (the package __init__)")
                elif dst_unit == "cli" and src_unit not in CLI_USERS:
                    bad.append(f"{where} (the command line)")
                elif dst_unit not in rank or src_unit not in rank:
                    bad.append(f"{where} (a unit missing from LAYERS)")
                elif rank[dst_unit] > rank[src_unit]:
                    bad.append(f"{where} (a layer above {src_unit})")
    return list(dict.fromkeys(bad))  # one line per import, however many names it takes


def test_no_upward_imports():
    bad = upward_imports(SRC)
    assert not bad, "imports against the layering (low -> high: " + " < ".join(LAYERS) + "):\n" + "\n".join(bad)


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").is_file()}
    assert units <= set(LAYERS), sorted(units - set(LAYERS))


# ---------------------------------------------------------------- the checker itself


def _tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


_CLEAN = {
    "__init__.py": "from .core import f\n",
    "core/__init__.py": "from .maths import f\n",
    "core/maths.py": "from ..runtime import kern\n\ndef f():\n    from . import maths\n",
    "runtime/__init__.py": "kern = 1\n",
    "cli/__init__.py": "",
    "cli/main.py": "from ..core import f\nfrom . import main\n",
    "__main__.py": "from .cli.main import f\n",
}
_SMALL = ("runtime", "core", "cli", "__init__", "__main__")


def test_checker_passes_a_clean_tree(tmp_path):
    root = _tree(tmp_path / "attngrad", _CLEAN)
    assert upward_imports(root, _SMALL) == []


@pytest.mark.parametrize(
    ("rel", "text", "why"),
    [
        ("runtime/up.py", "def g():\n    from ..core.maths import f\n", "a layer above runtime"),
        ("runtime/up.py", "import attngrad.core\n", "a layer above runtime"),
        ("core/up.py", "from ..cli import main\n", "the command line"),
        ("core/up.py", "from .. import f\n", "the package __init__"),
        ("core/up.py", "import attngrad\n", "the package __init__"),
        ("core/up.py", "from ..extra import thing\n", "a unit missing from LAYERS"),
    ],
)
def test_checker_finds_a_planted_upward_import(tmp_path, rel, text, why):
    root = _tree(tmp_path / "attngrad", {**_CLEAN, rel: text})
    bad = upward_imports(root, _SMALL)
    assert len(bad) == 1 and bad[0].startswith(f"attngrad/{rel}:") and f"({why})" in bad[0], bad
