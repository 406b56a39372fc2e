"""Formulas you can trust: each gradient written once, rendered and evaluated.

- :mod:`.expr`: the tiny expression language (render LaTeX/Unicode, evaluate in NumPy);
- :mod:`.catalogue`: every formula of every flavor, and their evaluation;
- :mod:`.document`: the document ``attngrad derive`` prints;
- :mod:`.graph`: the computation graph ``attngrad graph`` writes (DOT, SVG, PNG).
"""

from .catalogue import FLAVORS, Catalogue, catalogue, evaluate_catalogue, layer_env
from .document import FORMATS, derive_document
from .graph import GRAPH_FORMATS, GraphvizError, graph_dot, write_graph

__all__ = [
    "FLAVORS",
    "FORMATS",
    "GRAPH_FORMATS",
    "Catalogue",
    "GraphvizError",
    "catalogue",
    "derive_document",
    "evaluate_catalogue",
    "graph_dot",
    "layer_env",
    "write_graph",
]
