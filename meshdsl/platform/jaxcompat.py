"""Every use of jax internals (``jax._src``) in meshdsl, in one small module.

The rewriter needs these things public jax does not offer: the trace being built now and the
traces enclosing it (to hoist the relayout of a value a ``md.scan`` step captures out of the
loop), running code in an enclosing trace, a trace built apart and thrown away (the planner
prices a candidate there, undifferentiated), dead-code elimination of a jaxpr (``md.explain``
drops collectives the compiler drops), whether a value is being differentiated (an einsum
weighs its backward collectives too), and the variable a traced value is (the planner asks which
forward values the program never reads), and which outputs of a jaxpr do not depend on given inputs, replayed
alone (a streamed loop's backward pass makes again what it computes from a fetched slice). Name
scopes give each host transfer the user's line (:func:`line_scope`, read back through loop bodies
and transpositions). A jax upgrade that moves them breaks this file only.

Public-API helpers that belong with them: :func:`varying_axes` (the ``shard_map`` type of a value).

It also reads the parameters of jaxpr equations, whose forms change between jax versions
(:func:`scan_parts`, :func:`called_jaxpr`, :func:`dot_dims`): every reader of ``eqn.params`` in
meshdsl goes through them. jax 0.10 writes a ``scan``'s operand groups as counts (``num_consts``,
``num_carry``, with ``linear``); jax 0.11 and 0.12 as a flat tree (``ft_in``: the tuple
``(consts, carry, xs)`` of their leaves; ``ft_out``: ``(carry, ys)``). ``while`` (``body_jaxpr``,
``body_nconsts``, ``cond_jaxpr``, ``cond_nconsts``), ``jit``/``pjit`` and ``shard_map``
(``jaxpr``) and ``dot_general`` (``dimension_numbers``) read alike in all three.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src import util as _util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe

__all__ = ["current_trace", "parent_trace", "enclosing_trace", "in_trace", "apart", "pricing", "fresh", "dce",
           "free_of", "replay", "line_scope", "name_stack", "scoped_line", "backward",
           "varying_axes", "differentiated", "primal_var", "forget_staged", "ScanParts", "scan_parts", "called_jaxpr", "dot_dims", "MATMULS", "matmul_groups",
           "HOST_MEMORY", "host_memory_kind", "to_memory", "in_host_memory", "host_resident"]

_APART: dict = {}   # id(trace built apart) -> the trace it stands in for

# jax caches what it traces by function and argument types (a jax.checkpoint'ed function, a jitted
# one, a loop body). The rewriter's rules are not pure (what they emit is recorded; the plan
# answers their questions): a function of the user's traced by one of the rewriter's traces must
# not be replayed from the cache by another. The caches are emptied whole: picking jax's own
# functions (jnp's jitted helpers) out to keep them read every key, and the caches grow with every
# layout traced (a search over T5-xxl: 30 ms a trace, 13 s of 77); they hit little across traces
# (other local shapes).
_TRACE_CACHES = (_pe.trace_to_jaxpr, _ad_checkpoint._trace_to_jaxpr)


def varying_axes(array) -> frozenset:
    """Mesh axes jax's type system says ``array`` varies over (empty outside ``shard_map``)."""
    try:
        return frozenset(jax.typeof(array).mat.varying)
    except (AttributeError, TypeError):
        return frozenset()


def differentiated(value) -> bool:
    """Is ``value`` being differentiated (a tracer of ``jax.grad``'s forward pass)? Its
    operations then also run backward, and their backward collectives count. In a trace built
    :func:`apart`, a value computed from one is."""
    trace = getattr(value, "_trace", None)
    if isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace)):
        return True
    if id(trace) not in _APART:
        return False
    stack, seen = [value], set()
    while stack:   # back through what the apart trace computed it from, to the values it read
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if getattr(t, "_trace", None) is not trace:
            if differentiated(t):
                return True
            continue
        read = trace.frame.constvar_to_val.get(t.val) if isinstance(t.val, _core.Var) else None
        if read is not None:
            if differentiated(read):
                return True
        elif t.parent is not None:
            stack.extend(t.parent.in_tracers)
    return False


def current_trace():
    """The jax trace being built now."""
    return _core.trace_ctx.trace


def parent_trace(trace):
    """The trace enclosing ``trace`` (``None`` at the top)."""
    return getattr(trace, "parent_trace", None)


def enclosing_trace(value, trace):
    """The trace owning tracer ``value`` if it strictly encloses ``trace``, else ``trace``. A
    trace built :func:`apart` stands in for the trace it was opened in: a value of that trace is
    owned by it."""
    owner = getattr(value, "_trace", None)
    if owner is None or owner is trace:
        return trace
    below, t = trace, parent_trace(trace)
    while t is not None:
        if t is owner:
            return below if id(below) in _APART else owner
        below, t = t, parent_trace(t)
    return trace


def stands_for(trace):
    """The trace ``trace`` stands in for (itself, or the trace one built :func:`apart` was opened in)."""
    return _APART.get(id(trace), trace)


@contextlib.contextmanager
def fresh():
    """One of the rewriter's traces, as a trace of its own to jax: a function of the user's that
    jax traced before (in another trace, another candidate) is traced again, its rules run, and
    what is traced inside is not replayed by a later trace."""
    _forget_users_traces()
    try:
        yield
    finally:
        _forget_users_traces()


def _forget_users_traces() -> None:
    for cache in _TRACE_CACHES:
        cache.cache_clear()


def forget_staged() -> None:
    """Empty jax's staging caches (what it traced, keyed by function and argument types; the
    executables a jitted function compiled stay). A search traces each layout at other local
    shapes, so nothing of one is reused by the next, and kept they grew by ~7 MB a T5-xxl layout
    (743 MB after 59 layouts; 330 MB emptied after each)."""
    clear = getattr(_util, "clear_all_caches", None)
    (clear or jax.clear_caches)()


@contextlib.contextmanager
def apart():
    """Build what runs inside into a fresh trace thrown away after (a candidate the planner
    prices): it reads the values of the traces around it as constants and differentiates nothing,
    so it costs what tracing the forward alone costs, and leaves no dead code behind."""
    parent = current_trace()
    trace = _pe.DynamicJaxprTrace(None, parent_trace=parent)
    _APART[id(trace)] = parent
    try:
        with _core.set_current_trace(trace):
            yield
    finally:
        del _APART[id(trace)]
        trace.invalidate()


def pricing() -> bool:
    """Is the code running now only priced (built into a trace :func:`apart`, nothing between it
    and the code but jaxpr traces)? Nothing built there is ever differentiated or run: a
    hand-written derivative need not be attached (:func:`meshdsl.rewrite.collectives.attributed_vjp`)."""
    trace = current_trace()
    while isinstance(trace, _pe.DynamicJaxprTrace):
        if id(trace) in _APART:
            return True
        trace = parent_trace(trace)
    return False


@contextlib.contextmanager
def in_trace(trace):
    """Build what runs inside into ``trace`` (an enclosing trace) instead of the current one."""
    with _core.set_current_trace(trace):
        yield


def primal_var(value):
    """The jaxpr variable that ``value`` (a tracer, of ``jax.grad``'s forward pass or not) is in
    the program being traced - its primal's - or None (a constant; a value of an inner trace)."""
    while isinstance(value, (_ad.JVPTracer, _ad.LinearizeTracer)):
        value = value.primal
    if isinstance(value, _pe.DynamicJaxprTracer) and isinstance(value.val, _core.Var):
        return value.val
    return None


_LINE = re.compile(r"mdl\[([^\]]*)\]")   # the name scope of a user's line (:func:`line_scope`)


def line_scope(line: str):
    """A name scope saying that what is traced inside comes from the user's ``line``
    (``file:line``), read back by :func:`scoped_line` (through jax's transpositions too)."""
    return jax.named_scope(f"mdl[{line}]")


def name_stack(eqn, outer: str = "") -> str:
    """The name scopes around the jaxpr equation ``eqn``, after ``outer`` (those of the equations
    calling the program it is in: a loop body's equations name only the scopes inside it)."""
    return f"{outer}/{eqn.source_info.name_stack}"


def scoped_line(eqn, outer: str = "") -> str:
    """The user's ``file:line`` of the innermost :func:`line_scope` around the jaxpr equation
    ``eqn`` (in a program called under the scopes ``outer``), else ``"?"``."""
    scoped = _LINE.findall(name_stack(eqn, outer))
    return scoped[-1] if scoped else "?"


def backward(eqn, outer: str = "") -> bool:
    """Did the jaxpr equation ``eqn`` (called under the scopes ``outer``) come from a
    transposition (a backward pass)?"""
    return "transpose(" in name_stack(eqn, outer)


def dce(jaxpr):
    """``jaxpr`` without the computations whose results are never used (as XLA drops them)."""
    return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def free_of(closed, inputs) -> list:
    """Per output of the closed jaxpr ``closed``: is it computed without the inputs the mask
    ``inputs`` selects (read by no equation it depends on)?"""
    jaxpr = closed.jaxpr
    tainted = {v for v, t in zip(jaxpr.invars, inputs) if t}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, _core.Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return [not (isinstance(v, _core.Var) and v in tainted) for v in jaxpr.outvars]


def replay(closed, keep, args) -> list:
    """The outputs the mask ``keep`` selects of the closed jaxpr ``closed`` on ``args`` (its
    inputs), running only the equations they need."""
    jaxpr, used = _pe.dce_jaxpr(closed.jaxpr, list(keep))
    return _core.eval_jaxpr(jaxpr, closed.consts, *[a for a, u in zip(args, used) if u])


# -- jaxpr equations' parameters, in each jax version's form ------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScanParts:
    """A ``scan`` equation read the same way under every jax: its body (an open jaxpr whose inputs
    are ``consts + carry + xs`` and outputs ``carry + ys``), the number of iterations, and how many
    of the body's inputs are loop constants and carried values."""

    body: object
    length: int
    n_consts: int
    n_carry: int

    @property
    def xs(self) -> tuple:
        """The body's inputs that are one slice of a stacked operand per iteration."""
        return tuple(self.body.invars[self.n_consts + self.n_carry:])


def scan_parts(params) -> ScanParts:
    """:class:`ScanParts` of a ``scan`` equation's ``params`` (or the equation itself), from jax
    0.10's counts (``num_consts``, ``num_carry``) or jax 0.11+'s flat trees (``ft_in``)."""
    params = getattr(params, "params", params)
    body = params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    if "num_consts" in params:
        n_consts, n_carry = int(params["num_consts"]), int(params["num_carry"])
    elif "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        n_consts, n_carry = len(consts), len(carry)
    else:
        raise NotImplementedError(f"a scan whose params are {sorted(params)}: this jax ({jax.__version__}) "
                                  f"writes its operand groups in a form meshdsl.platform.jaxcompat does not know")
    return ScanParts(body, int(params["length"]), n_consts, n_carry)


def called_jaxpr(eqn):
    """The closed jaxpr a ``jit`` (``pjit``) or ``shard_map`` equation calls, or the primal program
    of a ``custom_vjp_call`` / ``custom_jvp_call`` (what runs: its rules only made the derivative);
    ``None`` for others."""
    if eqn.primitive.name in ("pjit", "jit", "shard_map"):
        return eqn.params.get("jaxpr")
    if eqn.primitive.name in ("custom_vjp_call", "custom_jvp_call"):
        return eqn.params.get("call_jaxpr")
    return None


#: the matmul primitives (a grouped matmul, ``ragged_dot_general``, multiplies each row by its group's matrix)
MATMULS = frozenset(("dot_general", "ragged_dot_general"))


def matmul_groups(eqn) -> int:
    """How many matmuls of its shape a matmul primitive runs: 1 for a ``dot_general``; a grouped
    matmul's group count, as XLA runs it (its ragged-dot expander: every row against every group's
    matrix, masked - on CPU and wherever no grouped-GEMM kernel replaces it)."""
    if eqn.primitive.name != "ragged_dot_general":
        return 1
    dims = eqn.params["ragged_dot_dimension_numbers"]
    return eqn.invars[1].aval.shape[dims.rhs_group_dimensions[0]] if dims.rhs_group_dimensions else 1


def dot_dims(eqn) -> tuple:
    """``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` of a ``dot_general`` (or of a
    ``ragged_dot_general``'s matmul: each row against its group's matrix)."""
    if eqn.primitive.name == "ragged_dot_general":
        return eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    return eqn.params["dimension_numbers"]


def pad_config(eqn) -> tuple:
    """``((low, high, interior), ...)`` per axis of a ``pad`` equation, as ints."""
    return tuple(tuple(int(x) for x in axis) for axis in eqn.params["padding_config"])


def slice_window(eqn) -> tuple:
    """``(starts, sizes)`` of a ``slice`` with unit strides (``starts`` ints) or of a
    ``dynamic_slice`` (``starts`` ``None``: its operands), else ``None`` (a strided slice)."""
    if eqn.primitive.name == "dynamic_slice":
        return None, tuple(int(s) for s in eqn.params["slice_sizes"])
    strides = eqn.params.get("strides")
    if strides is not None and any(int(s) != 1 for s in strides):
        return None
    starts = tuple(int(s) for s in eqn.params["start_indices"])
    return starts, tuple(int(b) - a for a, b in zip(starts, eqn.params["limit_indices"]))


HOST_MEMORY = "pinned_host"   # the host memory kind offloaded state lives in (DMA-able, as MaxText's)


def host_memory_kind(device=None) -> str | None:
    """:data:`HOST_MEMORY` where ``device`` (the first device) can address it, else ``None``."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return HOST_MEMORY if HOST_MEMORY in kinds else None


def to_memory(tree, where: str):
    """Inside ``jax.jit``: ``tree``'s arrays moved to ``"device"`` or ``"host"`` memory, each keeping
    its split (a host <-> device transfer XLA schedules; no collective)."""
    space = {"device": jax.memory.Space.Device, "host": jax.memory.Space.Host}[where]
    return jax.device_put(tree, space)


def host_resident(array) -> bool:
    """Is ``array`` (a jax array or a tracer) in host memory?"""
    return isinstance(array, jax.Array) and in_host_memory(jax.typeof(array))


def in_host_memory(aval) -> bool:
    """Is a traced value of abstract value ``aval`` in host memory (``f32<host>[..]``: moved there
    by ``device_put``, an offloading remat policy)?"""
    return str(getattr(aval, "memory_space", "")).endswith("Host")
