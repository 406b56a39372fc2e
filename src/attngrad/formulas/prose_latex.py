"""Prose with symbols in it, written as LaTeX: the symbols as maths, the words as text.

The documents of ``attngrad derive`` carry prose written once in Unicode for the terminal
("δ_i = Σ_j P_ij dP_ij", "bias of W^Q", "(Lq, H·Dv)").  :func:`prose_latex` turns it into
LaTeX for ``--format latex``: each run of symbols becomes one ``$…$`` span (``P_{ij}``,
``\\delta_{i}``, ``W^{Q}``, ``L_q``), code names (``qk_norm_eps``) a ``\\texttt`` span, the
rest escaped text.  :func:`shape_latex` writes a shape such as "(Lq, H·Dv)" as maths.

The rules, word by word (words are separated by spaces):
- a symbol: a word with ``_`` or ``^`` (not a code name), a Greek letter or another maths
  glyph (∂ √ ∘ · ᵀ ≤ ⁰ …), a single letter (``a`` only beside other maths; ``A`` unless a
  lowercase word follows, as in "A row"), a gradient name (``dX``, ``db``), a shape letter
  (``Lq``, ``Dv``) or a name applied to an argument (``exp(S_ij``, ``diag(p)``);
- an operator (``=``, ``−``, ``/``, …) or a number joins a run of symbols it stands in;
- a comma, semicolon, colon or full stop after a word ends the run, unless it stands
  inside brackets the run opened ("(i, j)", "J_i[k, j]");
- brackets a run does not close (or did not open) stay outside the maths.
Any character the rules do not know raises ValueError, so that pdflatex never drops one.
"""

from __future__ import annotations

import re

__all__ = ["prose_latex", "shape_latex", "text_latex"]

# maths glyphs -> LaTeX (in maths mode)
_MATH = {
    "δ": r"\delta", "Σ": r"\sum", "∂": r"\partial", "∘": r"\odot", "·": r"\cdot", "ᵀ": r"^{\top}",
    "−": "-", "≤": r"\le", "≥": r"\ge", "𝓜": r"\mathcal{M}", "𝓥": r"\mathcal{V}", "…": r"\dots",
    "ℓ": r"\ell", "Δ": r"\Delta", "θ": r"\theta", "σ": r"\sigma", "Γ": r"\Gamma", "ε": r"\varepsilon",
    "μ": r"\mu", "λ": r"\lambda", "∞": r"\infty", "→": r"\to", "⟨": r"\langle", "⟩": r"\rangle",
    "′": "'", "×": r"\times", "ℝ": r"\mathbb{R}", "∈": r"\in", "%": r"\%", "#": r"\#", "&": r"\&",
    "{": r"\{", "}": r"\}", "𝟙": r"\mathbb{1}",
}
_SUPER = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789", strict=True))
_ACCENT = {"\u0302": r"\hat", "\u0303": r"\tilde"}  # combining circumflex, tilde
_GLYPHS = set(_MATH) - {"−", "…", "%", "#", "&", "{", "}"} | set(_SUPER) | set(_ACCENT) | {"_", "^", "√"}
_TEXT = {  # text mode
    "…": r"\dots{}", "−": "-", "—": "---", "–": "--", "_": r"\_", "^": r"\^{}", "&": r"\&", "%": r"\%",
    "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "\\": r"\textbackslash{}",
    "’": "'", "é": r"\'e",
}
_SHAPE_NAMES = {"Lq": "L_q", "Lk": "L_k", "Dv": "D_v", "Em": "E_m", "Hkv": "H_{kv}"}
_OPERATORS = {"=", "−", "-", "+", "/", "<", ">", "<=", ">=", "≤", "≥", "×", "→", "|", "·", "∘", "//", "…",
              "≈", "∈"}
_NUMBER = re.compile(r"^[0-9][0-9.,/()−+-]*$|^[()]*[0-9][0-9./()−+-]*$|^[0-9.]+e[-+][0-9]+$")
_CALL = re.compile(r"[A-Za-zδσθ][(\[]")  # a name applied to an argument: exp(S, idx[b
_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9.]*(?:_[A-Za-z0-9]+)+(?:'s)?$")
_GRAD = re.compile(r"^d(?:[A-Z]|[bzswax])$")
_TAG = re.compile(r"[A-Z]{1,3}[0-9]")
_COMBO = re.compile(r"^(?=.*[A-Za-z])(?=.*[0-9/+*−-])[A-Za-z0-9/()+*.−-]+$")
_FUNCS = {"exp", "log", "tanh", "sech", "cos", "sin", "max", "min", "diag"}
_TEX_FUNCS = {"exp", "log", "tanh", "cos", "sin", "max", "min"}  # LaTeX's own \exp, ...
_TRAIL = ",.;:"
_OPEN, _CLOSE = "([⟨{", ")]⟩}"


def _is_code(core: str) -> bool:
    """qk_norm_eps, sdpa_backward's, attngrad.dropout_mask: a name with a long lowercase part."""
    if not _CODE.match(core):
        return False
    parts = core.removesuffix("'s").replace(".", "_").split("_")
    return "." in core or any(len(p) >= 3 and p.isalpha() and p.islower() for p in parts)


def _kind(word: str, prev_word: str | None = None, next_word: str | None = None) -> str:
    """"code", "strong" (surely maths), "weak" (maths beside maths) or "text"."""
    core = word.rstrip(_TRAIL).strip("\"").removesuffix("'s")
    bare = core.strip("()[]⟨⟩|")
    if not bare:
        return "text"
    if _is_code(bare.rstrip(_TRAIL)):
        return "code"
    if _TAG.search(bare):  # an equation tag (A4), (TK1-TK5), V7: prose
        return "text"
    if bare in _OPERATORS or _NUMBER.match(bare):
        return "weak"
    if core in ("a", "(a"):  # the article, or a variable beside maths ("the angle a = p θ")
        return "weak"
    if bare == "A":  # "A row with ...": the article at a sentence's start
        initial = prev_word is None or prev_word.endswith(".")
        after = (next_word or "").strip("\"(")
        return "text" if initial and after[:1].islower() and _kind(after) == "text" else "strong"
    if any(c in _GLYPHS for c in core) or _CALL.search(bare) or bare in _FUNCS:
        return "strong"
    if re.fullmatch(r"[A-Za-z]|[0-9]+[a-z]", bare) or _GRAD.match(bare) or bare in _SHAPE_NAMES:
        return "strong"
    if _COMBO.match(bare) and all(len(n) == 1 or n in _SHAPE_NAMES for n in re.findall("[A-Za-z]+", bare)):
        return "strong"  # R/2, Z/(1, h+1
    return "text"


def _group(s: str, i: int) -> tuple[str, int]:
    """The group after ``_`` or ``^`` at s[i:]: {…}, (…) or a run of letters/digits."""
    if i < len(s) and s[i] in "{(":
        close = "}" if s[i] == "{" else ")"
        depth, j = 0, i
        while j < len(s):
            depth += s[j] == s[i]
            depth -= s[j] == close
            if depth == 0:
                break
            j += 1
        inner = s[i + 1 : j]
        return (inner if s[i] == "{" else _math(inner)), j + 1
    m = re.match(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]", s[i:])
    if not m:
        return "", i
    g = m.group(0)
    if g.isalpha() and g.islower() and len(g) >= 3:
        g = rf"\mathrm{{{g}}}"
    elif len(g) == 1 and g in _MATH:
        g = _MATH[g]
    return g, i + m.end()


def _math(s: str) -> str:
    """A run of symbols (one or more words) in LaTeX maths, without the dollars."""
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c.isalpha() and c.isascii():
            m = re.match(r"[A-Za-z]+", s[i:])
            name = m.group(0)
            i += m.end()
            if name in _SHAPE_NAMES:
                out.append(_SHAPE_NAMES[name])
            elif len(name) == 1:
                out.append(name)
            elif _GRAD.match(name):  # dX: two atoms, so that an accent takes the X
                out += ["d", name[1]]
            elif name[0] == "d" and name[1].isupper():  # dBias
                out.append(rf"d\operatorname{{{name[1:]}}}")
            elif name in _TEX_FUNCS:
                out.append(rf"\{name} ")
            else:
                out.append(rf"\operatorname{{{name}}}")
            continue
        if c in "_^":
            g, i = _group(s, i + 1)
            out.append(f"{c}{{{g}}}")
            continue
        if c in _SUPER:
            m = re.match(f"[{''.join(_SUPER)}]+", s[i:])
            out.append("^{" + "".join(_SUPER[d] for d in m.group(0)) + "}")
            i += m.end()
            continue
        if c in _ACCENT:  # applies to the atom before it
            out[-1] = f"{_ACCENT[c]}{{{out[-1]}}}" if out else ""
            i += 1
            continue
        if c == "√":
            g, i = _group(s, i + 1)
            out.append(rf"\sqrt{{{g}}}")
            continue
        if s.startswith(("<=", ">="), i):
            out.append(r"\le " if c == "<" else r"\ge ")
            i += 2
            continue
        if c == " ":
            prev, nxt = (out[-1] if out else ""), s[i + 1 : i + 2]
            out.append(r"\, " if (prev[-1:].isalnum() or prev.endswith("}")) and nxt.isalnum() else " ")
            i += 1
            continue
        if c in _MATH:
            t = _MATH[c]
            out.append(t + (" " if t[-1:].isalpha() and t.startswith("\\") else ""))
        elif c.isascii() and c not in "\\$~":
            out.append(c)
        else:
            raise ValueError(f"prose_latex: no LaTeX for {c!r} in {s!r}")
        i += 1
    return "".join(out).strip()


def text_latex(text: str) -> str:
    """Plain text escaped for LaTeX (no maths): specials, dashes, quotes."""
    out = []
    for c in text:
        if c in _TEXT:
            out.append(_TEXT[c])
        elif c.isascii():
            out.append(c)
        elif c in _MATH or c in _SUPER:
            out.append(f"${_math(c)}$")
        else:
            raise ValueError(f"prose_latex: no LaTeX for {c!r} in {text!r}")
    return "".join(out)


def _split_brackets(run: str) -> list[tuple[bool, str]]:
    """(is_maths, piece) of a run: brackets it does not match stay outside the maths."""
    stack, unmatched = [], set()
    for i, c in enumerate(run):
        if c in _OPEN:
            stack.append(i)
        elif c in _CLOSE:
            if stack and _OPEN.index(run[stack[-1]]) == _CLOSE.index(c):
                stack.pop()
            else:
                unmatched.add(i)
    unmatched |= set(stack)
    pieces, start = [], 0
    for i in sorted(unmatched):
        pieces += [(True, run[start:i]), (False, run[i])]
        start = i + 1
    pieces.append((True, run[start:]))
    return [(m and bool(re.search(r"[^\s]", p)), p) for m, p in pieces if p]


def _emit_run(words: list[str]) -> str:
    run = " ".join(words)
    out = []
    for is_math, piece in _split_brackets(run):
        if not is_math:
            out.append(text_latex(piece))
            continue
        lead = piece[: len(piece) - len(piece.lstrip())]
        trail = piece[len(piece.rstrip()) :]
        body = piece.strip()
        if not re.search(r"[A-Za-z0-9" + "".join(_GLYPHS) + "]", body):
            out.append(lead + text_latex(body) + trail)
        else:
            out.append(f"{lead}${_math(body)}${trail}")
    return "".join(out)


def _quotes(text: str) -> str:
    """Straight double quotes as TeX's opening and closing quotes."""
    parts = text.split('"')
    return "".join(p + ("``" if k % 2 == 0 else "''") for k, p in enumerate(parts[:-1])) + parts[-1]


def _is_number(word: str) -> bool:
    return bool(_NUMBER.match(word.rstrip(_TRAIL).strip("()")))


def _run_latex(run: list[str], kinds: list[str]) -> str:
    """A run of strong and weak words: the maths span from its first to its last symbol
    (with numbers after it, "= 0", and operators and numbers before it, "1 bᵀ"); the
    article "a" and operators left dangling stay text."""
    strong = [k for k, kind in enumerate(kinds) if kind == "strong"]
    k0, k1 = strong[0], strong[-1]
    numbers = [k for k in range(k1 + 1, len(run)) if _is_number(run[k])]
    k1 = numbers[-1] if numbers else k1
    while k0 > 0 and (run[k0 - 1] != "a" or (kinds[k0] == "weak" and run[k0] in _OPERATORS)):
        k0 -= 1
    body = run[k0 : k1 + 1]
    last = body[-1]
    core = last.rstrip(_TRAIL)
    punct = last[len(core) :]
    if core.endswith("'s"):
        core, punct = core[:-2], "'s" + punct
    body[-1] = core
    pieces = [" ".join(text_latex(w) for w in run[:k0]), _emit_run(body) + text_latex(punct),
              " ".join(text_latex(w) for w in run[k1 + 1 :])]
    return " ".join(p for p in pieces if p)


def prose_latex(text: str) -> str:
    """A line of Unicode prose as LaTeX: symbols in ``$…$``, code in ``\\texttt``."""
    tokens = re.split(r"( +)", _quotes(text))
    words, gaps = tokens[0::2], [*tokens[1::2], ""]
    kinds = [_kind(w, words[k - 1] if k else None, words[k + 1] if k + 1 < len(words) else None)
             if w else "text" for k, w in enumerate(words)]
    out: list[str] = []
    run: list[str] = []
    run_kinds: list[str] = []
    depth = 0
    for k, (w, kind) in enumerate(zip(words, kinds, strict=True)):
        gap = r"\quad " if len(gaps[k]) > 1 else gaps[k]
        if kind in ("strong", "weak"):
            run.append(w)
            run_kinds.append(kind)
            depth = max(depth + sum(c in _OPEN for c in w) - sum(c in _CLOSE for c in w), 0)
            ends = (w.removesuffix("'s")[-1:] in _TRAIL or w.endswith("'s")) and depth == 0
            if not (ends or len(gaps[k]) > 1 or k + 1 == len(words) or kinds[k + 1] not in ("strong", "weak")):
                continue
            if "strong" in run_kinds:
                out.append(_run_latex(run, run_kinds))
            else:
                out.append(" ".join(text_latex(x) for x in run))
            run, run_kinds, depth = [], [], 0
        elif kind == "code":
            core = w.strip("`'(").rstrip(_TRAIL + ")'")
            i = w.index(core)
            out.append(text_latex(w[:i]) + rf"\texttt{{{text_latex(core)}}}" + text_latex(w[i + len(core) :]))
        else:
            out.append(text_latex(w))
        out.append(gap)
    return "".join(out).rstrip()


def shape_latex(shape: str) -> str:
    """A shape ("(Lq, H·Dv)", "(E,)", "scalar", "(E, H) | (E, H·Dv)") in LaTeX."""
    if not re.search(r"[()]", shape):
        return text_latex(shape)
    return "$" + _math(shape).replace("|", r"\mid ") + "$"
