"""One training run's machinery: the placed model, the train state, the jitted step, evaluation.

    trainer = Trainer(config, mesh, layout, tx, schedule, seed=0, accum=1, remat="none")
    state = trainer.init_state()          # {"params", "opt_state", "step", "rng"}, placed
    state, metrics = trainer.step(state, batches)
    val = trainer.evaluate(state, val_batches)

The model is built inside ``md.lower`` so its parameters come out placed by the layout's storage
rules (``md.random`` is layout-invariant: the values do not depend on the layout). One training
step is one ``jax.jit`` with the state donated:

    for each of `accum` microbatches:      the lowered program (md.lower): loss, metrics and
        grads += grad_fn(params, mb, key)   gradients; the rewriter emits every collective
    grads /= accum                          (gradients come back in the parameters' storage layout)
    params, opt_state = optax update        on the global arrays: Adafactor's factored moments and
                                            global-norm clipping see whole values

A layout that offloads the optimizer state (``md.Layout(..., offload="optimizer")``) keeps it in
host memory between steps: the step brings it to the device for the update and sends the new state
back (the state's bytes each way per step, :meth:`Trainer.transfers`); on the device it is held
only while the update runs.

Batches are dicts of global arrays ``[accum, batch / accum, length]`` (see :class:`Feed`); the
``accum`` microbatches interleave the rows so every device holds its share of each microbatch.

Every rule of the layout must name a dim the model computes with: the training and evaluation
programs are lowered with ``unused_rules="error"``, and :meth:`Trainer.check_layout` says so before
anything compiles, naming the model and its dims (``heads: model`` on Llama, whose attention dim is
``kv_heads``, would otherwise shard nothing). ``attention`` forces ``md.attention``'s context
parallelism strategy (``md.lower(..., attention=)``; None: the planner's choice).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import meshdsl as md
from meshdsl.names.errors import suggest
from meshdsl.models.data.batches import make_dataset
from meshdsl.models.families.family import model_class, objective
from meshdsl.models.families.loss import batch_arrays
from meshdsl.models.training import checkpoint
from meshdsl.names.named import is_named
from meshdsl.platform.jaxcompat import HOST_MEMORY, host_memory_kind, to_memory

__all__ = ["Trainer", "Feed", "host_metrics", "named_batch"]


def named_batch(arrays: dict) -> dict:
    """A batch of ``[batch, length]`` jax arrays as NamedArrays, with the dims that the loss names
    the data pipeline's features (:func:`meshdsl.models.loss.batch_arrays`)."""
    sample = batch_arrays({k: np.zeros((1, 1), np.int32) for k in arrays})
    return {k: md.named(a, sample[k].names) for k, a in arrays.items()}


class Trainer:
    """The model, optimizer and compiled programs of one run on one mesh and layout."""

    def __init__(self, config, mesh: md.Mesh, layout: md.Layout, tx: optax.GradientTransformation, schedule, *,
                 seed: int = 0, accum: int = 1, remat: str = "none", param_gather: str = "keep",
                 param_dtype=jnp.float32, dtype=jnp.float32, debug_nan_at_step: int | None = None,
                 pipeline_schedule: str = "gpipe", repeats: int = 1, attention: str | None = None,
                 memory_budget=None):
        self.config, self.mesh, self.layout = config, mesh, layout
        if layout.offload and host_memory_kind(mesh.jax_mesh.devices.flat[0]) is None:
            raise md.LayoutError(f"layout {layout} offloads {', '.join(sorted(layout.offload))} to host memory, but "
                                 f"the {mesh.jax_mesh.devices.flat[0].platform} devices here have no "
                                 f"{HOST_MEMORY!r} memory; remove the offload")
        self.tx, self.schedule, self.seed, self.accum, self.remat = tx, schedule, seed, accum, remat
        self.debug_nan_at_step = debug_nan_at_step
        # dtype: the compute dtype; every layer casts its (param_dtype) weights to it at use, so
        # gradients, parameters and optimizer state stay in param_dtype (mixed precision)
        # the model of the config (T5 / MoE-T5, or a decoder-only Llama) and the loss that trains it
        build, self.objective = model_class(config), objective(config)
        self._build = md.lower(lambda key: build(config, rngs=nnx.Rngs(params=key), param_dtype=param_dtype,
                                                 dtype=dtype), mesh, layout)
        abstract = nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(params=0), param_dtype=param_dtype, dtype=dtype))
        self.graphdef, self._abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
        if jax.tree_util.tree_leaves(rest):
            raise ValueError(f"{config.name} holds state besides parameters ({rest}); the trainer keeps only nnx.Param")
        # pipeline_schedule: how a layout that splits 'layers' pipelines the stacks (md.lower's schedule);
        # repeats: the circular schedule's chunks per stage (md.lower's repeats); attention: md.attention's
        # context parallelism strategy (md.lower's attention); a rule for a dim the model lacks is an error
        strict = dict(schedule=pipeline_schedule, repeats=repeats, attention=attention, unused_rules="error")
        # memory_budget: per device, what the training step's plan holds at most (remat="auto" then
        # recomputes where the activations do not fit)
        self.grad_fn = md.lower(self._loss_and_grads, mesh, layout, param_gather=param_gather,
                                memory_budget=memory_budget, **strict)
        self.eval_fn = md.lower(self._eval_metrics, mesh, layout, **strict)
        self._compiled = self._eval = None

    # -- the named programs (run by md.lower) ----------------------------------------------------

    def model(self, params):
        return nnx.merge(self.graphdef, params, nnx.State({}))

    def _loss_and_grads(self, params, batch, key):
        def objective(p):
            loss, metrics = self.objective(self.model(p), batch, key=key, train=True, remat=self.remat)
            return loss.array, (loss, metrics)
        (_, (loss, metrics)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return grads, {"total_loss": loss, **metrics}

    def _eval_metrics(self, params, batch):
        loss, metrics = self.objective(self.model(params), batch, train=False)
        return {"total_loss": loss, **metrics}

    # -- the layout's rules -----------------------------------------------------------------------

    def model_dims(self, batch: dict) -> frozenset[str]:
        """Every dim name the model computes with on ``batch`` (NamedArrays of one microbatch,
        abstract ones too), its parameters' and the batch's included: what a layout rule may name.
        One shape-only trace of the evaluation program, unsharded (nothing computed or compiled)."""
        traced = md.lower(self._eval_metrics, self.mesh, md.Layout({}), planner=False)
        _, ctx, _ = traced.trace(self._abstract_params, batch)
        return frozenset(d for d in ctx.dims_seen if not d.endswith("_"))   # (a trailing _: an op's own dim)

    def check_layout(self, batch: dict, kinds=("layout rule", "params layout rule")) -> None:
        """LayoutError for a rule of the layout (``kinds[0]``) or of its storage rules
        (``kinds[1]``) that names no dim of :meth:`model_dims`: it would shard nothing."""
        dims = None
        for kind, rules in zip(kinds, (self.layout.rules, self.layout.param_rules)):
            for dim, axes in rules.items():
                dims = self.model_dims(batch) if dims is None else dims
                if dim not in dims:
                    raise md.LayoutError(f"{kind} {dim!r} matches no dim of {self.config.name} (its dims: "
                                         f"{', '.join(sorted(dims))}){_rule_hint(dim, axes, dims)}")

    # -- state -----------------------------------------------------------------------------------

    def _init(self) -> dict:
        # called inside jax.jit: the lowered init then places the parameters by the storage rules
        params = nnx.state(self._build(jax.random.key(self.seed)), nnx.Param)
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(jax.random.fold_in(jax.random.key(self.seed), 1))}

    def init_state(self) -> dict:
        """Parameters, optimizer state, step 0 and the run's RNG key, placed by the layout (the
        parameters' values do not depend on the layout: ``md.random`` is layout-invariant)."""
        shardings = self.state_shardings(self.abstract_state())
        return jax.jit(self._init, out_shardings=shardings)()

    def abstract_state(self) -> dict:
        """The train state's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), e.g. to restore."""
        return jax.eval_shape(self._init)

    def state_shardings(self, state):
        """Where each leaf of a train state lives (optimizer statistics follow their parameter)."""
        return checkpoint.shardings(state, self.mesh, self.layout)

    # -- the step --------------------------------------------------------------------------------

    def _grads(self, params, batches, key):
        def one(mb, k):   # (offloaded parameters' gradients arrive in host memory: summed on the device)
            grads, metrics = self.grad_fn(params, named_batch(mb), jax.random.fold_in(key, k))
            return (to_memory(grads, "device") if "params" in self.layout.offload and self.accum > 1 else grads), metrics

        if self.accum == 1:
            grads, metrics = one({n: a[0] for n, a in batches.items()}, 0)
            return grads, _arrays(metrics)

        def body(acc, xs):
            mb, k = xs
            grads, metrics = one(mb, k)
            return jax.tree_util.tree_map(jnp.add, acc, grads), _arrays(metrics)

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        grads, stacked = jax.lax.scan(body, zeros, (batches, jnp.arange(self.accum)))
        grads = jax.tree_util.tree_map(lambda g: g / self.accum, grads)
        metrics = {n: v.sum(0) if n == "tokens" else v.mean(0) for n, v in stacked.items()}
        return grads, metrics

    def _train_step(self, state, batches):
        params, step = state["params"], state["step"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
        grads, metrics = self._grads(params, batches, key)
        if self.debug_nan_at_step is not None:  # tests: a NaN gradient at that (1-based) step
            bad = step + 1 == self.debug_nan_at_step
            grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.nan, g).astype(g.dtype), grads)
        offload, streamed = "optimizer" in self.layout.offload, "params" in self.layout.offload
        # an offloaded optimizer state comes to the device for the update and goes back to the host;
        # offloaded parameters (streamed to the step's layers, their gradients back to the host) too
        opt_state = to_memory(state["opt_state"], "device") if offload else state["opt_state"]
        if streamed:
            params, grads = to_memory(params, "device"), to_memory(grads, "device")
        updates, opt_state = self.tx.update(grads, opt_state, params)
        opt_state = to_memory(opt_state, "host") if offload else opt_state
        new_params = optax.apply_updates(params, updates)
        grad_norm, param_norm = optax.tree.norm(grads), optax.tree.norm(new_params)
        # the loop saves the new state only if all three are finite
        finite = jnp.isfinite(metrics["total_loss"]) & jnp.isfinite(grad_norm) & jnp.isfinite(param_norm)
        metrics.update(lr=self.schedule(step), grad_norm=grad_norm, param_norm=param_norm, finite=finite)
        new_params = to_memory(new_params, "host") if streamed else new_params
        new = {"params": new_params, "opt_state": opt_state, "step": step + 1, "rng": state["rng"]}
        return new, metrics

    def compile(self, state, batches):
        """Compile the step for these shapes (once); returns the compiled executable."""
        if self._compiled is None:
            shardings = self.state_shardings(state)
            batch_shardings = jax.tree_util.tree_map(lambda a: a.sharding, batches)
            replicated = NamedSharding(self.mesh.jax_mesh, PartitionSpec())
            jitted = jax.jit(self._train_step, in_shardings=(shardings, batch_shardings),
                             out_shardings=(shardings, replicated), donate_argnums=0)
            self._compiled = jitted.lower(state, batches).compile()
        return self._compiled

    def step(self, state, batches):
        """One optimizer step over ``accum`` microbatches: ``(new state, metrics)`` (the old state's
        buffers are donated). Metrics are replicated jax arrays; see :func:`host_metrics`."""
        return self.compile(state, batches)(state, batches)

    # -- evaluation and reports ------------------------------------------------------------------

    def _eval_step(self, params, batch):
        return _arrays(self.eval_fn(params, named_batch({n: a[0] for n, a in batch.items()})))

    def evaluate(self, state, batches) -> dict:
        """Token-weighted mean of the eval metrics over ``batches`` (``[1, batch, length]`` each)."""
        if self._eval is None:
            self._eval = jax.jit(self._eval_step, out_shardings=NamedSharding(self.mesh.jax_mesh, PartitionSpec()))
        totals, tokens = {}, 0.0
        for b in batches:
            metrics = host_metrics(self._eval(state["params"], b))
            n = float(metrics.pop("tokens"))
            if n > 0:
                tokens += n
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64) * n
        return {k: v / max(tokens, 1.0) for k, v in totals.items()} | {"tokens": tokens}

    def transfers(self, state, hardware=None, report=None, accum: int = 1) -> list[dict]:
        """The host <-> device transfers of one step, per device: ``{"what", "direction", "bytes",
        "seconds"}`` (an offloaded optimizer state comes to the device and goes back: its bytes
        each way), the seconds on ``hardware``'s host link (a :class:`md.Hardware` or a profile's
        name; default: the profile of the mesh's platform). ``report``: the step's
        :meth:`explain` (of one of ``accum`` microbatches), whose transfers are the streamed
        parameters' exactly (each pass's slice fetched ahead of no layer included); without it,
        the parameters twice to the device and their gradients once back."""
        hw, out = md.Hardware.of(hardware, self.mesh), []
        # what moves each way per step: the optimizer state (in, out); parameters streamed to the
        # forward and again to the backward pass, their gradients out, both in for the update and
        # the updated parameters out
        trips = {"optimizer": ("opt_state", "optimizer state", (1, 1)), "params": ("params", "parameters", (2, 1))}
        for name in sorted(self.layout.offload):
            part, what, (ins, outs) = trips[name]
            per_device = self.bytes_per_device(state, part)
            moved = {"host to device": ins * per_device, "device to host": outs * per_device}
            if name == "params":   # the step's (explain's, or twice in and once out), and the update's
                step = (report.memory["transfers"] if report is not None else
                        {"to device": 2 * per_device, "to host": per_device})
                moved["host to device"] += accum * step["to device"]
                moved["device to host"] += accum * step["to host"]
            for direction, nbytes in moved.items():
                out.append({"what": what, "direction": direction, "bytes": nbytes,
                            "seconds": hw.host_seconds(nbytes)})
        return out

    def bytes_per_device(self, state, part: str) -> float:
        """Bytes one device holds of ``state[part]`` (``"params"``, ``"opt_state"``), as the layout
        stores it."""
        shardings = jax.tree_util.tree_leaves(self.state_shardings(state)[part])
        return float(sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                         for a, s in zip(jax.tree_util.tree_leaves(state[part]), shardings)))

    def explain(self, state, batches) -> md.Report:
        """md.explain of one microbatch's loss-and-gradient program (the collectives of a step)."""
        mb = named_batch({n: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for n, a in batches.items()})
        return md.explain(self._loss_and_grads, self.mesh, self.layout, state["params"], mb, jax.random.key(0),
                          param_gather=self.grad_fn.param_gather, schedule=self.grad_fn.schedule,
                          repeats=self.grad_fn.repeats, attention=self.grad_fn.attention)


def _rule_hint(dim: str, axes: tuple, dims) -> str:
    """What to write instead of a rule for ``dim``, a dim the model lacks."""
    axis = "+".join(axes) or "model"
    if dim == "heads" and "kv_heads" in dims:
        return f"; for Megatron on Llama use kv_heads:{axis} (its attention heads are kv_heads x groups)"
    if dim == "kv_heads" and "heads" in dims:
        return f"; for Megatron on T5 use heads:{axis}"
    hint = suggest(dim, dims)
    return f"{hint}; fix the dim name" if hint else "; drop the rule, or name one of these dims"


def _arrays(metrics: dict) -> dict:
    return {k: v.array if is_named(v) else v for k, v in metrics.items()}


def host_metrics(metrics: dict) -> dict:
    """jax arrays -> numpy values (whole on every process; every process must call it)."""
    def fetch(v):
        if not isinstance(v, jax.Array):
            return np.asarray(v)
        if v.is_fully_replicated:
            return np.asarray(v.addressable_data(0))
        if v.is_fully_addressable:
            return np.asarray(v)
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(v, tiled=True))
    return {k: fetch(v) for k, v in metrics.items()}


class Feed:
    """Global batches ``[accum, batch / accum, length]`` from this process's share of the data.

    The layout decides which rows each device holds; each process loads only the rows of its own
    devices (``make_dataset(process_index=, process_count=)``, which in the usual data-parallel
    mesh are ``jax.process_index()`` and ``jax.process_count()``) and
    ``jax.make_array_from_process_local_data`` assembles the global arrays. ``kind="lm"`` batches
    get a one-token encoder input (EOS), so the encoder-decoder trains its decoder as a language model.
    """

    def __init__(self, kind: str, split: str, batch: int, encoder_length: int, decoder_length: int | None,
                 mesh: md.Mesh, layout: md.Layout, *, seed: int = 0, accum: int = 1, start_step: int = 0,
                 text_files=None, vocab=None):
        self.check_batch(batch, accum, mesh, layout)
        self.batch, self.accum, self.kind = batch, accum, kind
        self.spec = layout.spec(md.shape(f"batch:{batch // accum}"), mesh)  # rows; tokens stay whole
        self.sharding = NamedSharding(mesh.jax_mesh, PartitionSpec(None, *self.spec, None))
        self.index, self.count = self._share(mesh)
        self._it = make_dataset(kind, split, batch, encoder_length, decoder_length, seed, self.index, self.count,
                                start_step, text_files, vocab)

    @staticmethod
    def check_batch(batch: int, accum: int, mesh: md.Mesh, layout: md.Layout) -> None:
        """ValueError unless ``accum`` microbatches of ``batch / accum`` rows fit the layout."""
        if batch % accum:
            raise ValueError(f"--batch {batch} is not divisible by --accum {accum}")
        devices = mesh.axes_size(layout.axes("batch"))
        if (batch // accum) % devices:
            raise ValueError(f"a microbatch of {batch // accum} rows (--batch {batch} / --accum {accum}) cannot be "
                             f"split over the {devices} devices of mesh axes {layout.axes('batch')} that the layout "
                             f"gives 'batch'; make --batch / --accum a multiple of {devices}")

    def _share(self, mesh) -> tuple[int, int]:
        """(index, count) of this process's block of rows, from the devices it holds."""
        rows = NamedSharding(mesh.jax_mesh, self.spec)
        spans = {(s[0].start or 0, s[0].stop or self.batch // self.accum)
                 for s in rows.addressable_devices_indices_map((self.batch // self.accum,)).values()}
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        size = hi - lo
        covered = sum(b - a for a, b in sorted(spans))
        if covered != size or (self.batch // self.accum) % size or lo % size:
            raise ValueError(f"this process's devices hold rows {sorted(spans)} of the batch, not one block; "
                             "order the mesh so each process holds a contiguous share of 'batch'")
        return lo // size, (self.batch // self.accum) // size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        local = next(self._it)
        if self.kind == "lm":  # the encoder sees one EOS token: the decoder learns to continue text
            local["encoder_input_tokens"] = np.ones((len(local["decoder_target_tokens"]), 1), np.int32)
        out = {}
        for name, rows in local.items():
            n, length = rows.shape
            micro = rows.reshape(n // self.accum, self.accum, length).transpose(1, 0, 2)
            out[name] = jax.make_array_from_process_local_data(
                self.sharding, np.ascontiguousarray(micro), (self.accum, self.batch // self.accum, length))
        return out

    def take(self, n: int) -> list:
        """Up to ``n`` batches (fewer when a finite split runs out)."""
        out = []
        for b in self:
            out.append(b)
            if len(out) == n:
                break
        return out
