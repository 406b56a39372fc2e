"""Formulas you can trust: each gradient written once, rendered and evaluated.

- :mod:`.expr`: the tiny expression language (render LaTeX/Unicode, evaluate in NumPy);
- :mod:`.catalogue`: every formula of every flavor, and their evaluation;
- :mod:`.document`: the document ``attngrad derive`` prints;
- :mod:`.graph`: the computation graph ``attngrad graph`` writes (DOT, SVG, PNG);
- :mod:`.numeric`: every intermediate of a tiny case, beside its tag (``derive --numeric``).
"""

from .catalogue import FLAVORS, Catalogue, catalogue, evaluate_catalogue, layer_env
from .document import FORMATS, derive_document
from .graph import GRAPH_FORMATS, Graph, GraphvizError, computation_graph, graph_dot, write_graph
from .numeric import Walkthrough, numeric_walkthrough

__all__ = [
    "FLAVORS",
    "FORMATS",
    "GRAPH_FORMATS",
    "Catalogue",
    "Graph",
    "GraphvizError",
    "Walkthrough",
    "catalogue",
    "computation_graph",
    "derive_document",
    "evaluate_catalogue",
    "graph_dot",
    "layer_env",
    "numeric_walkthrough",
    "write_graph",
]
