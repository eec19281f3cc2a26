"""``--layout auto``: the training step's mesh and layout chosen by ``md.search``.

The step searched is the one the run trains (the model's loss and gradients, the run's ``--remat``, a
batch of the run's shapes, abstract: nothing is computed); ``--remat auto`` leaves the stacks'
remat policy to each layout's plan (none, dots or full: the fastest its solve finds within the budget),
and the run takes the best layout's. Over the device count when ``--mesh``
is left at its default (every factorisation into ``data`` or ``data x model``), else over the mesh
given; the dims placed are the model's parallel ones (batch, heads, d_ff, vocab, d_model; experts
and group for MoE; kv_heads for Llama), with ZeRO-3 storage tried for each. The time model runs on ``--hardware``
(``measure``: constants fitted on the devices at hand, a few seconds) and candidates over
``--memory-budget`` are rejected. The ranking is printed; the run takes the best, and records its
mesh and layout (``run.json``), so ``--resume`` continues with the same choice
(:func:`choose_for_run` writes them into the CLI's options).
"""

from __future__ import annotations

import io
import math

import jax
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

import meshdsl as md
from meshdsl.models.families.family import model_class, objective
from meshdsl.models.families.loss import t5_loss
from meshdsl.models.training.faults import UsageError
from meshdsl.names.units import fmt_bytes

__all__ = ["DEFAULT_MESH", "REMAT_CHOICES", "abstract_batch", "choose", "choose_for_run", "planned_remat", "rules_text",
           "step_of"]

DEFAULT_MESH = "data:-1"
REMAT_CHOICES = md.REMAT_AUTO_CHOICES   # what --remat auto chooses among (none, dots, full)
_DIMS = ("batch", "heads", "kv_heads", "d_ff", "vocab", "d_model", "experts", "group", "d_shared")


def step_of(remat: str, loss=t5_loss):
    """The training step searched: ``loss``'s value and gradients of ``model`` on ``batch``
    (``remat``: a policy, or ``"auto"``: the plan's choice; a keyword argument of the step)."""
    def step(model, batch, remat=remat):
        return nnx.value_and_grad(lambda m: loss(m, batch, train=True, remat=remat)[0].array)(model)
    return step


def abstract_batch(batch: int, encoder_length: int, decoder_length: int) -> dict:
    """A span-corruption batch of shapes only (``batch`` x encoder / decoder tokens)."""
    token = lambda length: jax.ShapeDtypeStruct((batch, length), np.int32)   # noqa: E731
    return {"encoder_input_tokens": md.named(token(encoder_length), "batch inputs"),
            "decoder_input_tokens": md.named(token(decoder_length), "batch targets"),
            "decoder_target_tokens": md.named(token(decoder_length), "batch targets"),
            "decoder_loss_weights": md.named(jax.ShapeDtypeStruct((batch, decoder_length), np.float32),
                                             "batch targets")}


def choose(config, *, mesh: str, batch: int, encoder_length: int, decoder_length: int, remat: str,
           hardware: str, memory_budget: str | None, say=print, tx=None, offload: bool = False):
    """``(mesh, layout, lower_kwargs, remat, result)`` of the best layout ``md.search`` finds; with
    ``tx`` (an optax transformation) each layout holds its state too, and with ``offload`` may
    keep it in host memory where it does not fit on the device."""
    model = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0)))
    args = (model, abstract_batch(batch, encoder_length, decoder_length))
    target = jax.device_count() if mesh == DEFAULT_MESH else md.Mesh.parse(mesh)
    if hardware == "measure":
        say("layout     measuring this machine's matmul, memory and link speeds (md.Hardware.measure)")
        hw = md.Hardware.measure(md.Mesh({"data": jax.device_count()}))
    else:
        hw = md.Hardware.profile(hardware)
    dims = [d for d in _DIMS if any(d in leaf.names for leaf in jax.tree_util.tree_leaves(
        args, is_leaf=lambda x: isinstance(x, md.NamedArray)) if isinstance(leaf, md.NamedArray))]
    result = md.search(step_of(remat, objective(config)), target, *args, memory_budget=memory_budget, hardware=hw, top=5,
                       dims=dims, zero=True, optimizer_state=0.0 if tx is None else state_per_param_byte(tx, model),
                       offload=offload)
    _print(result, say)
    best = result.best
    return best.mesh, best.layout, best.lower_kwargs, planned_remat(best.report) if remat == "auto" else remat, result


def state_per_param_byte(tx, model) -> float:
    """Bytes of ``tx``'s state per byte of ``model``'s parameters (AdamW: 2; Adafactor's factored
    moments: less)."""
    params = nnx.state(model, nnx.Param)
    size = lambda tree: sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize   # noqa: E731
                            for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))
    return size(jax.eval_shape(tx.init, params)) / max(size(params), 1)


def planned_remat(report) -> str:
    """The remat policy a plan took for its stacks (``remat="auto"``: each layout's solve weighs
    none, dots and full under the budget); where stacks differ, the one recomputing most."""
    taken = [d["chosen"].rsplit("; remat ", 1)[1] for d in report.decisions() if "; remat " in d["chosen"]]
    return max(taken, key=REMAT_CHOICES.index, default="none")


def choose_for_run(args, config, enc_len: int, dec_len: int, say, tx=None) -> None:
    """``--layout auto``: the mesh, layout and param_gather md.search ranks first (each layout
    holding ``tx``'s state, in host memory where ``--offload auto`` lets it and only that fits),
    written into ``args`` (so run.json records the choice and --resume keeps it)."""
    if args.params_layout:
        raise UsageError("--layout auto chooses the parameters' storage too: drop --params-layout")
    try:
        mesh, layout, kwargs, args.remat, _ = choose(
            config, mesh=args.mesh, batch=args.batch // args.accum, encoder_length=enc_len, decoder_length=dec_len,
            remat=args.remat, hardware=args.hardware, memory_budget=args.memory_budget, say=say, tx=tx,
            offload=args.offload == "auto")
    except (md.MeshDSLError, ValueError) as e:
        raise UsageError(f"--layout auto: {str(e).splitlines()[0]}") from e
    args.mesh = ",".join(f"{axis}:{size}" for axis, size in mesh.shape.items())
    args.layout = rules_text(layout.rules)
    args.params_layout = rules_text(layout.param_rules) or None
    args.param_gather = kwargs.get("param_gather", args.param_gather)
    args.offload = ",".join(sorted(layout.offload)) or None
    say(f"layout     auto: mesh {args.mesh}, layout {args.layout}"
        + (f", parameters stored {args.params_layout}" if args.params_layout else "") + f", remat {args.remat}"
        + (f", in host memory: {args.offload.replace(',', ' and ')}" if args.offload else ""))


def rules_text(rules) -> str:
    """``dim:axis+axis;...``, as --layout reads it."""
    return ";".join(f"{d}:{'+'.join(a)}" for d, a in rules.items() if a)


def _print(result, say) -> None:
    """The ranking as a rich table, printed as text."""
    table = Table(title=f"md.search: {result.costed} layouts costed in {result.seconds:.1f} s on {result.hardware}, "
                        f"{len(result.rejected)} rejected; the run takes the first")
    for column in ("rank", "mesh", "layout", "step time", "bytes/device", "peak memory"):
        table.add_column(column)
    for i, c in enumerate(result):
        table.add_row(str(i + 1), str(c.mesh), c.describe(), f"{c.time * 1e3:.3g} ms", fmt_bytes(c.total_bytes),
                      fmt_bytes(c.memory["peak"]))
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(table)
    say(console.export_text().rstrip())
