"""meshdsl.layers: flax NNX layers over named dims (T5, Switch/GShard MoE, Llama: grouped-query
attention with rotary positions).

Parameters are ``nnx.Param(md.param(NamedArray))``: their dim names alone place them under a
layout. Every parametrized layer takes ``stack=`` (e.g. ``md.Dim("layers", n)``) to prepend a stack
dim to its parameters, run with :func:`scan_layers`. Dropout is functional: layers that drop take
``key=`` (None: deterministic).
"""

from .attention import MASK_VALUE, Attention
from .dense import Dense
from .dropless import DroplessMoE
from .dropout import Dropout, dropout
from .embedding import Embedding
from .feedforward import ACTIVATIONS, FeedForward
from .gqa import GroupedQueryAttention
from .moe import MoE
from .norm import RMSNorm
from .position import RelativePositionBias, relative_position_bucket
from .rotary import apply_rotary, rotary_angles
from .router import Router, Routing, expert_capacity, route
from .stack import REMAT_POLICIES, layer_at, remat_policy, scan_layers, with_remat

__all__ = [
    "ACTIVATIONS", "Attention", "Dense", "DroplessMoE", "Dropout", "Embedding", "FeedForward", "GroupedQueryAttention",
    "MASK_VALUE", "MoE", "REMAT_POLICIES", "RMSNorm", "RelativePositionBias", "Router", "Routing", "apply_rotary",
    "dropout", "expert_capacity", "layer_at", "relative_position_bucket", "remat_policy", "rotary_angles", "route",
    "scan_layers", "with_remat",
]
