"""Named ops: one lowering rule per op, registered in :mod:`meshdsl.ops.registry` (its strategies'
costs declared next to it: :mod:`~meshdsl.ops.attention_cost`), and the math they share
(:mod:`~meshdsl.ops.flash`: blockwise attention; :mod:`~meshdsl.ops.balance`: zigzag positions).

May import: :mod:`meshdsl.platform`, :mod:`meshdsl.names`, :mod:`meshdsl.costmodel`,
:mod:`meshdsl.rewrite`.
"""

from .attention import attention
from .creation import arange, bernoulli, full, normal, ones, uniform, zeros
from .dynamic import dynamic_slice, dynamic_update_slice
from .einsum import einsum
from .experts import expert_ffn, ragged_dot
from .elementwise import (
    abs, add, astype, clip, cos, divide, equal, erf, exp, expm1, floor, gelu, greater, greater_equal,
    isfinite, less, less_equal, log, log1p, logical_and, logical_not, logical_or, maximum, minimum,
    multiply, negative, not_equal, power, relu, round, rsqrt, sigmoid, sign, silu, sin, softplus, sqrt,
    square, stop_gradient, subtract, tanh, where,
)
from .indexing import argmax, cumsum, one_hot, shift, top_k
from .local_map import local_map
from .lookup import take
from .operators import install as _install_operators
from .reductions import logsumexp, max, mean, min, softmax, sum
from .registry import RULES, op
from .scan import scan
from .restructure import rename, reshape, transpose
from .shaping import concat, pad, slice

_install_operators()
