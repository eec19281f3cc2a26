"""meshdsl: a Mesh-TensorFlow-style named-dimension sharding DSL on JAX.

Write a model once over named dims; a :class:`Layout` maps dim names to the axes of a
:class:`Mesh`; :func:`lower` rewrites the program into sharded einsums and explicit collectives,
and :func:`explain` reports what they cost before compiling. This module is the public contract
(``docs/contract.md``), re-exported; nothing else.
"""

from . import random
from .costmodel import hlo_comm   # the measuring side, public: ``from meshdsl import hlo_comm``
from .names.dims import Dim, Shape, shape
from .views.display import register_treescope, report_html, reports_table
from .names.errors import LayoutError, MemoryBudgetError, MeshDSLError, MeshError, ShapeError
from .views.explain import Report, explain
from .costmodel.hardware import Hardware
from .names.layout import OFFLOAD, Layout
from .lowering.lower import LoweredFunction, lower, place
from .names.mesh import Mesh
from .names.named import NamedArray, named, param
from .search.search import Candidate, SearchResult, search
from .ops import (
    abs, add, arange, argmax, attention, astype, clip, concat, cos, cumsum, divide, dynamic_slice, dynamic_update_slice, einsum, equal, expert_ffn, erf, exp, expm1,
    floor, full, gelu, greater, greater_equal, isfinite, less, less_equal, local_map, log, log1p, logical_and,
    logical_not, logical_or, logsumexp, max, maximum, mean, min, minimum, multiply, negative, not_equal,
    one_hot, ones, pad, power, ragged_dot, relu, rename, reshape, round, rsqrt, scan, shift, sigmoid, sign, silu, sin,
    slice, softmax, softplus, sqrt, square, stop_gradient, subtract, sum, take, tanh, top_k, transpose,
    where, zeros,
)
from .ops.remat import CHOICES as REMAT_AUTO_CHOICES, NAMES as REMAT_NAMES, POLICIES as REMAT_POLICIES, \
    policy as remat_policy
from .views.pipeline_plot import plot_pipeline
from .views.plots import device_blocks, plot_placement, plot_reports

from ._version import __version__

__all__ = [
    # names and values
    "Dim", "Shape", "shape", "NamedArray", "named", "param",
    # mesh, layout, lowering, cost
    "Mesh", "Layout", "OFFLOAD", "lower", "LoweredFunction", "place", "explain", "Report", "Hardware",
    "search", "SearchResult", "Candidate",
    # errors
    "MeshDSLError", "LayoutError", "MemoryBudgetError", "ShapeError", "MeshError",
    # ops
    "einsum", "add", "subtract", "multiply", "divide", "power", "negative", "maximum", "minimum",
    "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "square", "abs", "sign", "tanh", "sigmoid", "relu",
    "gelu", "silu", "softplus", "erf", "sin", "cos", "floor", "round", "isfinite", "clip", "astype",
    "stop_gradient", "less", "less_equal", "greater", "greater_equal", "equal", "not_equal",
    "logical_and", "logical_or", "logical_not", "where",
    "sum", "mean", "max", "min", "softmax", "logsumexp", "argmax", "top_k", "cumsum",
    "rename", "transpose", "reshape", "concat", "slice", "pad", "shift", "one_hot", "take",
    "attention", "expert_ffn", "ragged_dot", "full", "zeros", "ones", "arange", "scan", "local_map", "dynamic_slice", "dynamic_update_slice", "random",
    "remat_policy", "REMAT_POLICIES", "REMAT_NAMES", "REMAT_AUTO_CHOICES",
    # notebook views
    "register_treescope", "report_html", "reports_table", "device_blocks", "plot_placement", "plot_reports",
    "plot_pipeline",
    "__version__",
]
