"""The page around a report: one self-contained HTML document.

Nothing is fetched: no script, no external style sheet, font or image.  A Content
Security Policy in the page itself (``default-src 'none'``) makes any request the page
might try fail loudly instead of reaching the network; images are ``data:`` URIs inside
inline SVG, styles one inline ``<style>``.
"""

from __future__ import annotations

from html import escape

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_STYLE = """
body { font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 1.5em auto; max-width: 1180px;
       color: #1f2328; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; border-bottom: 2px solid #d0d7de; padding-bottom: .2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #d0d7de; }
h3 { font-size: 1.05em; margin-top: 1.2em; }
p.note, .muted { color: #57606a; font-size: .92em; }
table { border-collapse: collapse; font-size: .88em; margin: .6em 0; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: middle; }
th { background: #f6f8fa; }
td.num { text-align: right; font-family: "DejaVu Sans Mono", monospace; }
td.pass { color: #1a7f37; font-weight: bold; } td.fail { color: #cf222e; font-weight: bold; }
.eq { display: grid; grid-template-columns: 4.5em 1fr; align-items: center; margin: .15em 0; }
.eq .tag { color: #57606a; font-size: .9em; }
.eq math { margin: .2em 0; font-size: 1.12em; width: fit-content; }
.syms { columns: 2; column-gap: 2.5em; font-size: .86em; margin: .5em 0; }
.sym { break-inside: avoid; display: grid; grid-template-columns: 3.2em 7.5em 1fr; gap: .4em;
       border-bottom: 1px solid #eaeef2; padding: 2px 0; }
.sym .shape { color: #57606a; font-family: "DejaVu Sans Mono", monospace; font-size: .92em; }
.figs { display: flex; flex-wrap: wrap; gap: 10px 18px; align-items: flex-start; }
.graph { border: 1px solid #d0d7de; padding: 6px; }
.graph svg { max-width: 100%; height: auto; }  /* fits the page width (the graph is laid out narrow) */
details.symbols { margin: .6em 0; } details.symbols summary { cursor: pointer; color: #0969da; }
.walkthrough td.tag { color: #57606a; white-space: nowrap; }
.walkthrough pre { margin: 0; padding: 2px 4px; white-space: pre; }
.roundoff { color: #6e7781; font-style: italic; font-size: .9em; margin: 0; }
details.walk summary { cursor: pointer; color: #0969da; }
code, pre { font-family: "DejaVu Sans Mono", monospace; font-size: .9em; background: #f6f8fa; }
pre { padding: .6em; overflow-x: auto; white-space: pre-wrap; }
"""


def esc(s) -> str:
    return escape(str(s))


class HTMLPage(str):
    """A complete HTML page: a ``str`` (write it, search it) that a notebook (Jupyter,
    marimo) displays, inside an ``<iframe srcdoc>`` so that its style and its Content
    Security Policy stay its own."""

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{escape(str(self), quote=True)}" style="width:100%;height:640px;'
                'border:1px solid #d0d7de" sandbox title="attngrad report"></iframe>')


def page(title: str, body: str) -> HTMLPage:
    """A complete HTML document: the CSP, the inline style, ``body`` (HTML)."""
    return HTMLPage(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{esc(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"{body}\n</body>\n</html>\n"
    )


def table(header: list, rows: list, classes: list | None = None) -> str:
    """An HTML table; cells are HTML already (escape text with :func:`esc`)."""
    out = ["<table><thead><tr>", *(f"<th>{h}</th>" for h in header), "</tr></thead><tbody>"]
    for k, r in enumerate(rows):
        cls = classes[k] if classes else [""] * len(r)
        out.append("<tr>" + "".join(f'<td class="{c}">{v}</td>' if c else f"<td>{v}</td>"
                                    for v, c in zip(r, cls, strict=True)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def write_atomic(path, text: str):
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    import os
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
