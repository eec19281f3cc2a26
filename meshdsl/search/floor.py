"""What a layout of a program holds per device, and computes, at least, known before tracing the
layout: the floors under which ``md.search`` rejects a layout without costing it.

* **arguments and outputs** (exact): their dims come from one shape-only trace of the unsharded
  program; per device they are split as the layout places them (parameters by the storage rules).
* **the screen** (an estimate meant to stay under the costed peak): arguments and outputs, plus
  the temporaries the unsharded program holds at its peak (one trace of it, its liveness, a loop
  body's peak as the body's own buffers), each divided by at most what the layout could split it
  by. A buffer's dims are not known, only its shape: an axis of size ``s`` may be split by every
  placed dim whose size divides ``s`` (the dim itself, or a merge holding it), the buffer by no
  more than the placed dims fitting one of its axes together; a dim held in blocks over several
  axes (blockwise attention's ``[blocks, batch, block, heads, d]``: axes whose product is the
  dim's size) splits it too. Where two dims have one size this divides by both: the estimate
  errs low. A rename keeps the split. A context-parallel layout (an attention's positions split)
  is screened as its least-holding strategy, the ring (each device one chunk of queries and of
  keys): an attention over 8192 positions split over 4 devices holds 17.5 MB with the ring, the
  screen says 8.4. A layout splitting a dim an ``md.scan`` runs over (a pipeline) is screened
  as its stages hold it: the loop's stacked values split by the stages, the microbatch dim by
  the most microbatches its variants take (each stage runs one at a time). Measured against the costed peak on every
  layout of the t5-v1_1-xxl search (``bench/search_speed.py``) and of
  ``tests/test_search_costs_only_what_could_rank.py``, it never exceeded it; on the 449 costed
  layouts of llama-3-8b at 32k tokens on 64 devices (context-parallel ones among them) it did,
  by up to 3.5%, so ``md.search`` rejects by the screen without the margin it keeps under the
  costed peak (10%); ``md.search(..., screen=False)`` costs every layout anyway.
* **the compute floor** (:meth:`Held.compute_seconds`): the seconds its matmuls and attention
  kernels take at least, from the contractions the unsharded trace computes and the mesh axes
  the layout gives their dims. ``md.search`` costs layouts in the order of this floor and stops
  where it exceeds the step time of the last layout it keeps (``bound=False``: costs them all).
  It assumes a plan splits a contraction no more than the layout splits its dims (their renames
  and reshapes, parameters' storage included); a plan that reduce-scatters a sum onto a dim the
  layout leaves whole splits further - the layout naming that split is costed in its own right.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax

from ..costmodel import jaxpr_stats, liveness, roofline, simplify
from ..costmodel.step_time import kernel_seconds
from ..rewrite.contexts import DimsRecorder
from ..platform.jaxcompat import fresh
from ..costmodel.jaxpr_stats import nbytes
from ..names.layout import Layout, effective
from ..lowering.lower import lower
from ..ops import remat as remats
from ..names.named import is_named
from ..names.tracing import using

__all__ = ["Held"]


class Held:
    """What every layout of ``fn(*args)`` holds whatever it computes (see the module doc)."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.leaves = jax.tree_util.tree_leaves(args, is_leaf=is_named)
        recorder = DimsRecorder()
        try:
            with using(recorder), fresh():   # traced anew: a trace jax cached runs no rule
                out = jax.eval_shape(fn, *args)
            self.leaves += jax.tree_util.tree_leaves(out, is_leaf=is_named)
        except Exception:   # noqa: BLE001 - a program jax cannot trace unsharded: costed as before
            pass
        # the dims of each value the program holds: dims sharing one may not share an axis
        self.dim_sets = recorder.dim_sets | {frozenset(d.name for d in x.dims) for x in self.leaves if is_named(x)}
        self.sizes = {d.name: d.size for x in self.leaves if is_named(x) for d in x.dims}
        self.sizes.update({d: size for shape, dims in recorder.shapes.items() for names in dims
                           for d, size in zip(names, shape)})
        self.shapes = recorder.shapes             # shape -> the dims of the named values of it
        self.renamed = recorder.renamed
        self.scanned = recorder.scanned           # the dims an md.scan runs over
        self.work = recorder.work                 # the contractions it computes, whole
        self.remat_auto = recorder.remat_auto     # a stack's remat policy is each plan's choice
        self._related = _related(recorder.renamed, recorder.reshaped)
        self._temporaries = None   # the unsharded program's temporaries at its peak, traced when first screened
        self._kernels: list = []   # and its kernels (the same trace)
        self._kernel_s: dict = {}  # (hardware, dtype) -> their seconds at their FLOPs

    def per_device(self, mesh, layout) -> int:
        """Bytes per device of the arguments and outputs (not the parameters and their gradients
        where the layout keeps them in host memory); LayoutError where one cannot be placed."""
        return sum(_placed_bytes(leaf, mesh, layout) for leaf in self.leaves
                   if not ("params" in layout.offload and is_named(leaf) and leaf.is_param))

    def param_bytes(self, mesh, layout) -> int:
        """Bytes per device of the parameters among the arguments, as the layout stores them."""
        n = len(jax.tree_util.tree_leaves(self.args, is_leaf=is_named))
        return sum(_placed_bytes(leaf, mesh, layout) for leaf in self.leaves[:n] if is_named(leaf) and leaf.is_param)

    def screen(self, mesh, layout, floor: int, microbatches=None) -> int:
        """The screen's estimate of the layout's peak per device (``floor``: its arguments and
        outputs); ``floor`` itself where the unsharded program cannot be traced. Where the layout
        splits a dim an ``md.scan`` runs over (a pipeline), each stage runs one microbatch at a
        time: ``microbatches`` (dim -> the most microbatches its variants take; the layout's own
        where it names them) splits that dim further."""
        splits = {d: math.prod(mesh.shape[a] for a in axes) for d, axes in layout.rules.items() if axes}
        splits = {d: k for d, k in splits.items() if k > 1}
        if set(splits) & self.scanned:   # a pipeline: one microbatch at a time through each stage
            for d, m in (layout.microbatches or microbatches or {}).items():
                splits[d] = splits.get(d, 1) * m
        grown = True
        while grown:   # a rename keeps the split (through chains of renames)
            before = len(splits)
            splits.update({d: splits[old] for old, new in self.renamed.items() if old in splits
                           for d in new if d not in splits and d not in layout.rules})
            grown = len(splits) > before
        splits = {d: k for d, k in splits.items() if d in self.sizes and k > 1}
        temps = self.temporaries(mesh)
        return floor + sum(b.size // _most_split(b.shape, splits, self.sizes, self.shapes) for b in temps)

    def compute_seconds(self, mesh, layout, hardware, dtype=None) -> float:
        """The seconds per device the layout's matmuls and attention kernels take at least on
        ``hardware`` (each at its dtype's peak rate and efficiency, or ``dtype``'s): each
        contraction of the unsharded program (:class:`meshdsl.rewrite.contexts.Work`) split by
        no more than the mesh axes the layout gives its dims - those a rename or a reshape relates
        to them, and the parameters' storage axes (a plan may compute where a parameter is
        stored), included - forward, and backward (twice) where differentiated. The time model
        prices every kernel at its FLOPs or more and adds launches and collectives, so a
        layout's predicted step is never below this. Or, where larger, the unsharded program's
        matmul and attention kernels (:meth:`kernel_seconds`: remat's recomputation included)
        over the devices the layout's axes span."""
        used = {a for rules in (layout.rules, layout.param_rules) for axes in rules.values() for a in axes
                if a in mesh.shape}
        whole = self.kernel_seconds(mesh, hardware, dtype) / math.prod(mesh.shape[a] for a in used)
        total = 0.0
        for w in self.work:
            axes = {a for d in w.dims for n in self._related.get(d, (d,))
                    for a in (*layout.rules.get(n, ()), *layout.param_rules.get(n, ())) if a in mesh.shape}
            split = math.prod(mesh.shape[a] for a in axes)
            rate = hardware.attention_efficiency if w.kind == "attention" else hardware.matmul_efficiency
            peak = hardware.peak_flops(dtype) if dtype else hardware.matmul_peak(w.dtype)
            total += w.flops * (3 if w.grad else 1) / split / (peak * rate)
        return max(total, whole)

    def kernel_seconds(self, mesh, hardware, dtype=None) -> float:
        """The seconds the unsharded program's matmul and attention kernels take at their FLOPs
        (remat's second forward included: the kernels its trace runs; 0 where it cannot be
        traced). No layout splits one over more devices than its axes span."""
        key = (hardware.name, dtype)
        if key not in self._kernel_s:
            self.temporaries(mesh)
            self._kernel_s[key] = sum(k.count * kernel_seconds(k, hardware, dtype)[0] for k in self._kernels
                                      if k.kind in ("matmul", "attention"))
        return self._kernel_s[key]

    def temporaries(self, mesh) -> list:
        """The temporaries live at the unsharded program's peak (traced once, on ``mesh``
        with nothing split); none where it cannot be traced. A stack scanned with
        ``remat="auto"`` is traced recomputing all (``"full"``: what any plan holds at least), and
        again keeping all for its kernels (what any plan computes at least)."""
        if self._temporaries is None:
            try:
                with remats.auto_as("full" if self.remat_auto else None):
                    closed, ctx, _ = lower(self.fn, mesh, Layout({})).trace(*self.args)
                body = simplify.live(jaxpr_stats.inner_body(closed))
                self._temporaries = liveness.at_peak(body)
                if self.remat_auto:
                    with remats.auto_as("none"):
                        closed, ctx, _ = lower(self.fn, mesh, Layout({})).trace(*self.args)
                    body = simplify.live(jaxpr_stats.inner_body(closed))
                self._kernels = roofline.program_kernels(body, ctx.attentions)
            except Exception:   # noqa: BLE001 - a program that cannot run unsplit: not screened
                self._temporaries = []
        return self._temporaries


def _placed_bytes(leaf, mesh, layout) -> int:
    """Bytes per device of an argument or output ``leaf`` placed by ``layout`` (parameters as stored)."""
    if is_named(leaf):
        axes = effective(layout.tensor_axes(leaf.dims, mesh, storage=leaf.is_param,
                                            what=f"{'parameter' if leaf.is_param else 'value'} [{leaf.dims}]"), mesh)
        return nbytes(leaf.raw) // math.prod(mesh.axis_size(a) for ax in axes for a in ax)
    return nbytes(leaf) if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else 0


def _related(renamed, reshaped) -> dict:
    """dim -> every dim a chain of renames or reshapes (either way) relates it to, itself included."""
    links: dict = {}
    for table in (renamed, reshaped):
        for d, others in table.items():
            for o in others:
                links.setdefault(d, set()).add(o)
                links.setdefault(o, set()).add(d)
    out: dict = {}
    for d in links:
        if d in out:
            continue
        group, stack = {d}, [d]
        while stack:
            for o in links.get(stack.pop(), ()):
                if o not in group:
                    group.add(o)
                    stack.append(o)
        for o in group:
            out[o] = tuple(sorted(group))
    return out


def _most_split(shape, splits, sizes, named) -> int:
    """The most a buffer of ``shape`` can be split by the placed dims (``splits``: dim -> the
    devices splitting it). Where named values of the program have that shape (or it stacked by a
    loop: one more leading axis), by their dims (the most any of them is split); else per axis by
    the dims whose size divides the axis's, and in all by no more than the dims fitting some axis
    (a dim splits one axis)."""
    if shape is None:
        return math.prod(splits.values()) or 1
    known = named.get(shape, set()) | {(None, *dims) for dims in named.get(shape[1:], ())}
    if known:
        lead = {d for d, k in splits.items() if shape and sizes[d] == shape[0]}   # a loop over a placed dim
        return max(math.prod(splits.get(d, 1) for d in dims if d is not None) *
                   (max((splits[d] for d in lead), default=1) if dims and dims[0] is None else 1) for dims in known)
    per_axis = [min(s, math.prod(k for d, k in splits.items() if s % sizes[d] == 0)) for s in shape]
    fitting = math.prod(k for d, k in splits.items() if any(s % sizes[d] == 0 for s in shape))
    blocked = math.prod(k for d, k in splits.items()
                        if not any(s % sizes[d] == 0 for s in shape) and _in_blocks(tuple(shape), sizes[d]))
    return max(1, min(math.prod(per_axis) * blocked, fitting * blocked, math.prod(shape)))


@functools.lru_cache(maxsize=4096)
def _in_blocks(shape: tuple, size: int) -> bool:
    """Could a dim of ``size`` be held as blocks over two or more axes of ``shape`` (blockwise
    attention's ``[blocks, ..., block, ...]``: positions reshaped, the block count leading)?"""
    axes = [s for s in shape if 1 < s < size]
    return any(math.prod(c) == size for n in range(2, len(axes) + 1) for c in itertools.combinations(axes, n))
