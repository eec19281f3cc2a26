"""Train T5 / MoE-T5 with meshdsl: ``python -m meshdsl.models.train``.

With no arguments it trains ``t5-tiny`` with T5 span corruption on the King James Bible, data
parallel over all local devices (8 virtual CPU devices on a CPU-only machine), and writes under
``--out`` (default ``runs/<model>``): ``metrics.jsonl``, ``loss.png``, ``run.json`` and orbax
``checkpoints/``. Parallelism is two strings::

    --mesh data:2,model:4 --layout "batch:data;heads:model;d_ff:model;vocab:model"   # Megatron
    --params-layout d_model:data                                                    # + ZeRO-3
    --model moe-t5-tiny            # default layout adds group:data;experts:data (expert parallel)

At start it prints the model, its parameter count, the mesh, the layout and ``md.explain``'s
communication of one training step (bytes per device by collective kind), then the compiled
step's own count. ``--resume`` continues from the latest checkpoint, bit-identically, on any mesh
and layout, after checking that the run (model, optimizer, schedule, batch, data, seed) is the one
in ``run.json``. Every step's loss and gradient norm must be finite (else: exit 3, nothing saved);
SIGTERM / Ctrl-C save at the next step boundary and exit 0; checkpoints carry SHA-256 manifests
(see :mod:`meshdsl.models.faults` and :mod:`meshdsl.models.checkpoint`). Several processes
(hosts) train one model: ``--coordinator host:port --num-processes N --process-id I`` (or
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); each process loads its
share of every global batch. If one dies, the others stop ``--heartbeat-timeout`` seconds later with
one line naming it and the checkpoint to ``--resume`` from (exit 4; :mod:`meshdsl.models.supervisor`).

The setup lives here, the loop in :mod:`meshdsl.models.runloop`; the model, step and evaluation in
:mod:`meshdsl.models.trainer`,
optimizers in :mod:`meshdsl.models.optim`, logging and plots in :mod:`meshdsl.models.progress`,
``run.json`` and ``--config`` in :mod:`meshdsl.models.runrecord`.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
import time

from meshdsl.models import runrecord, supervisor
from meshdsl.models.configs import CONFIGS
from meshdsl.models.faults import Diverged, UsageError

__all__ = ["main", "cli", "build_parser", "parse_args"]

DEFAULT_STEPS = 300
DEFAULT_CKPT_EVERY = 100


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: ...)" only where there is one worth showing
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _step_range(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        first, last = int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"write FIRST:LAST (steps, e.g. 10:15), got {text!r}") from None
    if not sep or first < 1 or last < first:
        raise argparse.ArgumentTypeError(f"write FIRST:LAST with 1 <= FIRST <= LAST, got {text!r}")
    return first, last


def _step_signal(text: str) -> tuple[int, int]:
    """``STEP:NAME`` (e.g. ``3:TERM``): the process sends itself SIGNAME right after that step."""
    import signal
    step, _, name = text.partition(":")
    try:
        return int(step), int(getattr(signal, f"SIG{name.upper().removeprefix('SIG')}"))
    except (ValueError, AttributeError):
        raise argparse.ArgumentTypeError(f"write STEP:SIGNAL, e.g. 3:TERM, got {text!r}") from None


def _remat(text: str) -> str:
    """A remat policy of meshdsl.layers (a name, or value names to keep), checked at parse time."""
    from meshdsl.layers.stack import remat_policy
    try:
        remat_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


POSITIVE, NATURAL = _int_at_least(1), _int_at_least(0)
#: options whose values a --config file may give: checked like the command line's
_TYPES = {"microbatches": POSITIVE, "steps": POSITIVE, "batch": POSITIVE, "accum": POSITIVE, "log_every": POSITIVE, "keep": POSITIVE,
          "repeats": POSITIVE, "encoder_length": _int_at_least(2), "decoder_length": POSITIVE, "eval_every": NATURAL,
          "eval_batches": NATURAL, "eval_decode": NATURAL, "warmup": NATURAL, "ckpt_every": _int_at_least(-1), "lr": _positive_float,
          "heartbeat_timeout": POSITIVE, "remat": _remat}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meshdsl.models.train", formatter_class=_Help,
                                description="\n\n".join(__doc__.split("\n\n")[:3]).replace("``", ""))
    a = p.add_argument
    a("--config", dest="config_file", default=None, metavar="FILE",
      help="YAML or JSON file of options (the keys of a run's run.json); flags given here win")
    a("--model", default="t5-tiny", choices=sorted(CONFIGS), metavar="MODEL",
      help=f"one of: {', '.join(sorted(CONFIGS))}")
    a("--override", action="append", default=[], metavar="KEY=VALUE",
      help="change the model config, e.g. d_model=32,d_ff=64 (repeatable)")
    a("--mesh", default="data:-1", help="mesh axes, e.g. data:2,model:4 (-1: the remaining devices)")
    a("--layout", default=None, help="dim:axis rules; default batch:data (+ group:data;experts:data for MoE)")
    a("--params-layout", default=None, help="storage-only rules for parameters, e.g. d_model:data (ZeRO-3)")
    a("--microbatches", type=POSITIVE, default=None,
      help="a layout that splits 'layers' (e.g. layers:pipe) runs the stacks as a pipeline of this many "
           "microbatches along batch (--schedule)")
    a("--schedule", default="gpipe", metavar="NAME",
      help="pipeline schedule of a layout that splits 'layers': gpipe, 1f1b (dense T5: the decoder stack's loss "
           "inside the pipeline, temp memory flat in --microbatches; not MoE yet), circular (the decoder stack; "
           "each stage runs --repeats R chunks of it and microbatches go round the S stages R times: bubble "
           "(S-1)/(RM+S-1), not (S-1)/(M+S-1), for moving the chunks to their stage once per step; needs "
           "--microbatches >= S when R > 1 and layers divisible by S x R). T5's encoder stack is always gpipe")
    a("--repeats", type=POSITIVE, default=1, metavar="R",
      help="--schedule circular: chunks of the decoder stack per pipeline stage (1: the layers in GPipe's order)")
    a("--task", default="span_corruption", choices=("span_corruption", "lm"),
      help="lm: the decoder learns to continue text (the encoder sees one EOS token)")
    a("--steps", type=POSITIVE, default=DEFAULT_STEPS, help="optimizer steps")
    a("--batch", type=POSITIVE, default=32, help="global batch (sequences per step)")
    a("--encoder-length", type=_TYPES["encoder_length"], default=128,
      help="encoder tokens per example (span corruption)")
    a("--decoder-length", type=POSITIVE, default=None,
      help="default: span corruption's targets length for --encoder-length (29 for 128); lm: 64")
    a("--optimizer", default="adafactor", choices=("adafactor", "adamw"),
      help="adafactor: T5's (rsqrt schedule); adamw: clipping, warmup, cosine decay")
    a("--lr", type=_positive_float, default=None, help="peak learning rate (adafactor 1e-2, adamw 1e-3)")
    a("--warmup", type=NATURAL, default=None,
      help="warmup steps (adafactor: 10000, T5's; adamw: 5%% of --steps)")
    a("--decay", default="cosine", choices=("cosine", "rsqrt"), help="adamw's decay after warmup")
    a("--accum", type=POSITIVE, default=1, help="gradient accumulation: microbatches per step")
    a("--remat", type=_remat, default="none",
      help="what each layer keeps for the backward pass (the rest is recomputed): none (keep all), full "
           "(keep nothing), dots, einsums, collectives (never communicate again), sequence-parallel (gather "
           "the sequence shard again), or value names to keep: einsum,all-reduce,all-gather,...")
    a("--dtype", default="float32", choices=("float32", "bfloat16"),
      help="compute dtype: bfloat16 casts the parameters at use; gradients, parameters and optimizer state "
           "stay in --param-dtype")
    a("--param-dtype", default="float32", choices=("float32", "bfloat16"), help="parameter storage dtype")
    a("--param-gather", default="keep", choices=("keep", "regather", "auto"),
      help="weights stored split (--params-layout): keep the gathered copy for the backward pass, gather again "
           "there, or auto: gather only where that moves fewer bytes than moving the activations")
    a("--seed", type=int, default=0, help="parameters, data order, span noise and dropout")
    a("--out", default=None, help="output directory (default runs/<model>)")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --out (an error if none)")
    a("--resume-from", type=NATURAL, default=None, metavar="STEP",
      help="continue from this checkpoint step (newer checkpoints move to checkpoints.superseded/)")
    a("--allow-changes", action="store_true",
      help="resume although model/optimizer/schedule/batch/data/seed differ from run.json (recorded there)")
    a("--overwrite", action="store_true", help="start over in an --out that holds checkpoints (deletes them)")
    a("--eval-only", action="store_true",
      help="evaluate the run's checkpoint in --out (latest, or --resume-from STEP) on the run's data (task, "
           "batch, lengths, text files and seed from its run.json; flags given here win) and exit")
    a("--eval-every", type=NATURAL, default=100, help="validation every N steps (0: only at the end)")
    a("--eval-batches", type=NATURAL, default=8, help="validation batches (fixed; 0: no validation)")
    a("--eval-decode", type=NATURAL, default=0,
      help="validation batches to decode (greedy) at each evaluation: span filling exact match (span corruption)")
    a("--ckpt-every", type=_TYPES["ckpt_every"], default=DEFAULT_CKPT_EVERY,
      help="checkpoint every N steps, and at the end and on SIGTERM/Ctrl-C (0: only then; -1: never)")
    a("--keep", type=POSITIVE, default=3, help="checkpoints kept (the newest N)")
    a("--log-every", type=POSITIVE, default=10, help="metrics every N steps (tokens/s counts encoder + decoder "
      "positions, padding included)")
    a("--profile-steps", type=_step_range, default=None, metavar="FIRST:LAST",
      help="write a jax profiler trace of these steps to <out>/profile (TensorBoard's profile plugin, Perfetto)")
    a("--export-hf", default=None, metavar="DIR",
      help="at the end, write the model as a Hugging Face directory (safetensors, config.json, spiece.model)")
    a("--text-files", nargs="+", default=None, help="train on your own UTF-8 text (one document per line)")
    a("--no-explain", action="store_true", help="skip the md.explain communication report")
    a("--cpu-devices", type=NATURAL, default=8,
      help="virtual devices of the CPU platform (XLA_FLAGS), unless already set; ignored on GPU/TPU")
    a("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"), help="host:port of process 0")
    a("--num-processes", type=POSITIVE, default=_env_int("JAX_NUM_PROCESSES"), help="processes in the run")
    a("--process-id", type=NATURAL, default=_env_int("JAX_PROCESS_ID"), help="this process's index, 0 .. N-1")
    a("--heartbeat-timeout", type=POSITIVE, default=100,
      help="seconds without a heartbeat before the processes of a run declare a peer dead; they then stop "
           "with one line (exit 4), their full stderr in <out>/process-I.stderr.log")
    # for tests of the fault paths, hidden: NaN gradients at a step; a signal to itself after a step
    a("--debug-nan-at-step", type=POSITIVE, default=None, help=argparse.SUPPRESS)
    a("--debug-signal", type=_step_signal, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The CLI's options: the command line over a ``--config`` file over the defaults, checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config_file:
        parser.set_defaults(**_checked(runrecord.config_file_defaults(args.config_file, parser),
                                       f"--config {args.config_file}"))
        args = parser.parse_args(argv)
        if args.model not in CONFIGS:
            raise UsageError(f"--config {args.config_file}: unknown model {args.model!r}; one of "
                             f"{', '.join(sorted(CONFIGS))}")
    elif args.eval_only:  # the run's data, unless the command line says otherwise
        out = args.out or os.path.join("runs", args.model)
        parser.set_defaults(**_checked(runrecord.data_defaults(out), os.path.join(out, "run.json")))
        args = parser.parse_args(argv)
    if args.resume_from is not None:
        args.resume = True
    if args.eval_only and args.resume:
        args.resume = False  # --eval-only --resume-from STEP: which step to evaluate
    return args


def _checked(values: dict, source: str) -> dict:
    """Option values from a file, checked like the command line's (UsageError naming ``source``)."""
    for dest, value in values.items():
        if dest in _TYPES and value is not None:
            try:
                values[dest] = _TYPES[dest](str(value))
            except argparse.ArgumentTypeError as e:
                raise UsageError(f"{source}: {dest}: {e}") from None
    return values


def _env_int(name: str):
    value = os.environ.get(name)
    return int(value) if value else None


def _prepare_jax(args) -> None:
    """Before jax starts: virtual CPU devices, then the multi-process runtime."""
    flags = os.environ.get("XLA_FLAGS", "")
    if args.cpu_devices and "xla_force_host_platform_device_count" not in flags:
        # only the CPU platform reads it: on a GPU/TPU machine jax still uses the accelerators
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
    if args.coordinator:
        import jax
        if args.num_processes is None or args.process_id is None:
            raise UsageError("--coordinator needs --num-processes and --process-id "
                             "(or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
        try:
            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                       heartbeat_timeout_seconds=args.heartbeat_timeout)
        except Exception as e:  # noqa: BLE001 - the coordination service's errors are long
            raise UsageError(f"process {args.process_id} of {args.num_processes} could not join the run at "
                             f"{args.coordinator}: {str(e).strip().splitlines()[0][:300]}") from e


def _overrides(items) -> dict:
    out = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise UsageError(f"--override {pair!r}: write KEY=VALUE")
            try:
                out[key.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                out[key.strip()] = value.strip()
    return out


def _default_layout(config, mesh) -> str:
    axis = "data" if "data" in mesh.shape else mesh.axis_names[0]
    return f"batch:{axis}" + (f";group:{axis};experts:{axis}" if config.is_moe else "")


def main(argv=None) -> dict:
    """Run the CLI; returns ``{"records", "state", "trainer", "out", "baseline", "wall_s", "stopped"}``.

    A user's mistake raises :class:`UsageError` (exit 2), a diverged run :class:`Diverged` (exit 3),
    both after printing one line ``error: ...`` to stderr; a second Ctrl-C exits 130."""
    import meshdsl as md
    from meshdsl.models.checkpoint import CheckpointError

    try:
        args = parse_args(argv)
        _prepare_jax(args)
        try:
            return _run(args)
        except (md.MeshDSLError, CheckpointError) as e:
            raise UsageError(str(e)) from e
    except (UsageError, Diverged) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise
    except KeyboardInterrupt:
        print("interrupted: stopped at once, nothing saved since the last checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _run(args) -> dict:
    import jax
    import jax.numpy as jnp

    import meshdsl as md
    from meshdsl.models import faults, runinfo, runrecord
    from meshdsl.models.checkpoint import Checkpoints, latest_step, state_bytes
    from meshdsl.models.configs import get_config
    from meshdsl.models.data import random_spans_helper
    from meshdsl.models.optim import DEFAULT_LR, default_warmup, make_optimizer
    from meshdsl.models.trainer import Feed, Trainer, host_metrics

    t_start = time.perf_counter()
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    out = args.out or os.path.join("runs", args.model)
    ckpt_dir = os.path.join(out, "checkpoints")

    # -- checks that need nothing loaded: the schedule, the output directory, the checkpoints, the text files
    faults.check_schedule(args.schedule, args.repeats)
    if args.eval_only:
        if latest_step(ckpt_dir) is None:
            raise UsageError(f"--eval-only: no checkpoint under {ckpt_dir}")
    else:
        faults.check_out_dir(out)
        if args.resume and latest_step(ckpt_dir) is None:
            raise UsageError(f"--resume: no checkpoint under {ckpt_dir}; start the run without --resume "
                             "(or give the --out of the run to continue)")
        if not args.resume and latest_step(ckpt_dir) is not None:
            if not args.overwrite:
                raise UsageError(f"{ckpt_dir} holds checkpoints: pass --resume to continue that run, --overwrite "
                                 "to start over (deleting them), or choose another --out")
    faults.check_text_files(args.text_files)

    # -- the run: vocabulary, model, mesh, layout, optimizer ----------------------------------------
    vocab = faults.checked_vocabulary(args.text_files)
    try:
        config = get_config(args.model).replace(vocab=vocab.size, **_overrides(args.override))
    except TypeError as e:
        raise UsageError(f"--override: {e}; the model config's keys are "
                         f"{', '.join(sorted(get_config(args.model).__dict__))}") from e
    mesh = md.Mesh.parse(args.mesh)
    layout = md.Layout.parse(args.layout or _default_layout(config, mesh), args.params_layout)
    if args.microbatches:
        layout = md.Layout(layout.rules, layout.param_rules, microbatches={"batch": args.microbatches})
    layout.check_mesh(mesh)
    for warning in faults.mesh_warnings(mesh, layout):
        say(warning)
    enc_len, dec_len = runinfo.lengths(args, random_spans_helper)
    try:
        Feed.check_batch(args.batch, args.accum, mesh, layout)
    except ValueError as e:
        raise UsageError(str(e)) from e
    lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    warmup = default_warmup(args.optimizer, args.steps) if args.warmup is None else args.warmup
    identity = runrecord.run_identity(args, config, lr, warmup, enc_len, dec_len)
    record = {**vars(args), "config": config.__dict__, "identity": identity, "history": []}
    if args.resume or args.eval_only:
        stored = runrecord.read_run(out) or {}
        changes = runrecord.differences(stored.get("identity", {}), identity)
        model_changes = [c for c in changes if c.startswith("model ")]
        if args.eval_only and model_changes:
            raise UsageError(f"--eval-only: the checkpoint in {out} is of another model ({'; '.join(model_changes)}): "
                             f"pass the run's --model/--override, e.g. --config {os.path.join(out, 'run.json')}")
        if args.resume and changes and not args.allow_changes:
            raise UsageError(f"--resume: this run differs from {os.path.join(out, 'run.json')}: "
                             f"{'; '.join(changes)}. Use the run's options, or pass --allow-changes to accept these")
        if args.resume:
            record["history"] = stored.get("history", []) + ([runrecord.history_entry(-1, changes)] if changes else [])
            if changes:
                say(f"resume     accepting changes (--allow-changes): {'; '.join(changes)}")
        elif stored:
            record = stored  # --eval-only never rewrites run.json

    tx, schedule = make_optimizer(args.optimizer, lr, warmup, args.steps, args.decay)
    trainer = Trainer(config, mesh, layout, tx, schedule, seed=args.seed, accum=args.accum, remat=args.remat,
                      param_gather=args.param_gather, param_dtype=jnp.dtype(args.param_dtype),
                      dtype=jnp.dtype(args.dtype), debug_nan_at_step=args.debug_nan_at_step,
                      pipeline_schedule=args.schedule, repeats=args.repeats)
    like = trainer.abstract_state()
    if args.overwrite and not args.resume and not args.eval_only and latest_step(ckpt_dir) is not None:
        if lead:  # only now that every option checked out
            shutil.rmtree(ckpt_dir)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("meshdsl.train: old checkpoints removed")
    ckpts = Checkpoints(ckpt_dir, keep=args.keep, lead=lead, writable=not args.eval_only)
    try:
        for note in ckpts.notes:
            say(f"checkpoint {note}")
        if not args.eval_only:
            warning = faults.check_free_space(out, state_bytes(like), args.keep)
            if warning:
                say(warning)
        start = 0
        if args.resume or args.eval_only:
            step = args.resume_from
            if step is not None and not args.eval_only and step < (ckpts.latest_step() or 0):
                for moved in ckpts.discard_after(step):
                    say(f"checkpoint --resume-from {step}: moved the newer {moved} out of the way")
            seen = len(ckpts.notes)
            state = ckpts.restore(like, mesh, layout, step)
            start = int(host_metrics({"step": state["step"]})["step"])
            for note in ckpts.notes[seen:]:
                say(f"checkpoint {note}")
            if args.resume and record["history"] and record["history"][-1]["resumed_at_step"] == -1:
                record["history"][-1]["resumed_at_step"] = start
        else:
            state = trainer.init_state()
        val_batches = Feed(split="validation", batch=args.batch, mesh=mesh, layout=layout, kind=args.task,
                           encoder_length=enc_len, decoder_length=dec_len, seed=args.seed,
                           text_files=args.text_files, vocab=vocab).take(args.eval_batches) \
            if args.eval_batches > 0 else []
        if args.eval_only:
            return _evaluate_only(args, trainer, state, val_batches, start, out, say, vocab)
        return _train(args, trainer, state, start, ckpts, record, vocab, (enc_len, dec_len), val_batches, out,
                      t_start, say)
    finally:
        ckpts.close()


def _evaluate_only(args, trainer, state, val_batches, step: int, out: str, say, vocab) -> dict:
    import json

    from meshdsl.models.progress import jsonable
    from meshdsl.models.runloop import span_filling

    if not val_batches:
        raise UsageError("--eval-only needs --eval-batches > 0")
    val = trainer.evaluate(state, val_batches)
    record = {"step": step, **{f"val_{k}": v for k, v in val.items() if k != "tokens"}}
    record.update(span_filling(args, trainer, state, val_batches, vocab))
    say(f"eval       checkpoint step {step}: validation loss {record['val_loss']:.4f}, accuracy "
        f"{record.get('val_accuracy', float('nan')):.4f} over {int(val['tokens'])} tokens"
        + (f", span exact match {record['val_span_exact_match']:.4f}" if "val_span_exact_match" in record else ""))
    if __import__("jax").process_index() == 0:
        with open(os.path.join(out, "eval.jsonl"), "a") as f:
            f.write(json.dumps(jsonable(record)) + "\n")
    return {"records": [record], "state": state, "trainer": trainer, "out": out, "baseline": {}, "wall_s": 0.0,
            "stopped": None}


def _train(args, trainer, state, start, ckpts, record, vocab, lengths, val_batches, out, t_start, say) -> dict:
    from meshdsl.models import runinfo, runrecord
    from meshdsl.models.faults import Preemption
    from meshdsl.models.progress import MetricsLog, ProgressBar, plot_losses
    from meshdsl.models.runloop import loop
    from meshdsl.models.trainer import Feed

    import jax

    lead = jax.process_index() == 0
    enc_len, dec_len = lengths
    data = dict(kind=args.task, encoder_length=enc_len, decoder_length=dec_len, seed=args.seed,
                text_files=args.text_files, vocab=vocab)
    feed = Feed(split="train", batch=args.batch, mesh=trainer.mesh, layout=trainer.layout, accum=args.accum,
                start_step=start, **data)
    baseline = runinfo.baselines(args, vocab, enc_len, dec_len)
    say(runinfo.summary(args, trainer.config, trainer.mesh, trainer.layout, enc_len, dec_len, baseline))
    first = next(feed)
    if not args.no_explain:
        say(runinfo.explain_text(trainer.explain(state, first), args.accum))
    t0 = time.perf_counter()
    compiled = trainer.compile(state, first)
    say(f"compiled   one step in {time.perf_counter() - t0:.1f}s; {runinfo.hlo_text(compiled)}")

    if lead:
        runrecord.write_run(out, {**record, "layout": str(trainer.layout), "mesh": str(trainer.mesh), **baseline})
    log = MetricsLog(os.path.join(out, "metrics.jsonl"), resume_step=start if args.resume else None, enabled=lead,
                     tensorboard_dir=os.path.join(out, "tensorboard"))
    bar = ProgressBar(args.steps, start, enabled=lead)
    if start:
        bar.print(f"resumed from step {start} ({ckpts.directory})")
    try:
        with Preemption(notify=bar.print) as stop:
            state, records, stopped = loop(args, trainer, state, feed, first, val_batches, start,
                                           enc_len + dec_len, log, bar, ckpts, stop, out, vocab)
        ckpts.wait()
    finally:
        bar.close()
        log.close()
    wall = time.perf_counter() - t_start
    title = f"{trainer.config.name} · {trainer.mesh} · {trainer.layout}"
    if lead and os.path.exists(log.path) and not plot_losses(log.path, os.path.join(out, "loss.png"),
                                                             baseline["target_unigram_entropy"], title):
        say("(no loss.png: pip install matplotlib)")
    last_step = records[-1]["step"] if records else start
    if stopped:
        say(f"stopped    by {stopped} after step {last_step}: checkpoint saved in {ckpts.directory}; continue "
            f"with the same command plus --resume")
    elif records:
        last = records[-1]
        val = (f", validation loss {last['val_loss']:.3f} vs unigram baseline "
               f"{baseline['target_unigram_entropy']:.3f}") if "val_loss" in last else ""
        say(f"done       {last_step - start} steps in {wall:.0f}s: loss {last['loss']:.3f}{val}; written to {out}")
    else:
        say(f"done       the checkpoint is at step {start} >= --steps {args.steps}: nothing to train")
    if args.export_hf and not stopped and lead:
        from meshdsl.models import hf
        hf.save_pretrained(trainer.model(state["params"]), args.export_hf, vocab=vocab)
        say(f"exported   the model as a Hugging Face directory: {args.export_hf}")
    return {"records": records, "state": state, "trainer": trainer, "out": out, "baseline": baseline,
            "wall_s": wall, "stopped": stopped}


def cli(argv=None) -> int:
    """``python -m meshdsl.models.train``: :func:`main`; a multi-process run under a supervisor
    (:mod:`meshdsl.models.supervisor`: a dead peer is one line, exit 4). Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError:
        args = None  # main says what is wrong
    if args is not None and supervisor.wanted(args):
        return supervisor.supervise(argv, args)
    supervisor.watch_parent()
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
