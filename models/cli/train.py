"""Train T5, MoE-T5 (Switch) or the decoder-only Llama with meshdsl: ``python -m meshdsl.models.train``.

With no arguments it trains ``t5-tiny`` with T5 span corruption (Adafactor, T5's schedule) on the
King James Bible, data parallel over all local devices (8 virtual CPU devices on a CPU-only
machine), and writes under ``--out`` (default ``runs/<model>``): ``metrics.jsonl``, ``loss.png``,
``run.json`` and orbax ``checkpoints/``. ``--model llama-tiny`` (or ``llama-2-7b`` ...) trains the
decoder-only Llama on next-token prediction (``--task lm``) with AdamW (b1 0.9, b2 0.95, weight
decay 0.1, warmup 5% of the run up to 2000 steps, cosine decay). Parallelism is two strings::

    --mesh data:2,model:4 --layout "batch:data;heads:model;d_ff:model;vocab:model"   # Megatron (T5)
    --mesh data:2,model:4 --layout "batch:data;kv_heads:model;d_ff:model;vocab:model"  # (Llama)
    --params-layout d_model:data                                                    # + ZeRO-3
    --model moe-t5-tiny            # default layout adds group:data;experts:data (expert parallel)
    --model mixtral-tiny           # Mixtral / Qwen2-MoE decoders: default layout adds experts:data
    --mesh data:2,ctx:4 --layout "batch:data;length:ctx;seq:ctx;kv_seq:ctx" --attention ring  # context

Every rule must name a dim of the model (its parameters', its batch's or one it computes with):
a rule that shards nothing is a one-line error listing the model's dims, before anything compiles.
At start it prints the model, its parameter count, the mesh, the layout and ``md.explain``'s
communication of one training step (bytes per device by collective kind), then the compiled
step's own count. ``--resume`` continues from the latest checkpoint, bit-identically, on any mesh
and layout, after checking that the run (model, optimizer, schedule, batch, data, seed) is the one
in ``run.json``. Every step's loss and gradient norm must be finite (else: exit 3, nothing saved);
SIGTERM / Ctrl-C save at the next step boundary and exit 0; checkpoints carry SHA-256 manifests
(see :mod:`meshdsl.models.training.faults` and :mod:`meshdsl.models.training.checkpoint`). Several processes
(hosts) train one model: ``--coordinator host:port --num-processes N --process-id I`` (or
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); each process loads its
share of every global batch. If one dies, the others stop ``--heartbeat-timeout`` seconds later with
one line naming it and the checkpoint to ``--resume`` from (exit 4; :mod:`meshdsl.models.training.supervisor`).

The setup lives here, the loop in :mod:`meshdsl.models.training.runloop`; the model, step and
evaluation in :mod:`meshdsl.models.training.trainer`, optimizers in :mod:`meshdsl.models.training.optim`,
logging and plots in :mod:`meshdsl.models.training.progress`, ``run.json`` and ``--config`` in
:mod:`meshdsl.models.training.runrecord`, the options in :mod:`meshdsl.models.cli.options`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from meshdsl.models.cli import options
from meshdsl.models.training import supervisor
from meshdsl.models.training.faults import Diverged, ExchangeOverflow, UsageError

__all__ = ["main", "cli", "build_parser", "parse_args"]

_ABOUT = "\n\n".join(__doc__.split("\n\n")[:3]).replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser (:mod:`meshdsl.models.cli.options`), headed by this module's docstring."""
    return options.build_parser(_ABOUT)


def parse_args(argv=None) -> argparse.Namespace:
    """The CLI's options: the command line over a ``--config`` file over the defaults, checked."""
    return options.parse_args(argv, _ABOUT)


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


def _default_layout(config, mesh) -> str:
    axis = "data" if "data" in mesh.shape else mesh.axis_names[0]
    if not config.is_moe:
        return f"batch:{axis}"
    # expert parallelism; MoE-T5 also splits its routing groups (a dropless decoder has none)
    return f"batch:{axis}" + ("" if getattr(config, "decoder_only", False) else f";group:{axis}") + f";experts:{axis}"


def _check_rules(trainer, args, enc_len: int, dec_len: int) -> None:
    """A --layout or --params-layout rule that names no dim of the model: one line, before compiling."""
    from meshdsl.models.families.family import is_decoder_only
    from meshdsl.models.training.autolayout import abstract_batch

    batch = abstract_batch(args.batch // args.accum, enc_len, dec_len)
    if is_decoder_only(trainer.config):
        batch.pop("encoder_input_tokens")
    trainer.check_layout(batch, ("--layout rule", "--params-layout rule"))


def main(argv=None) -> dict:
    """Run the CLI; returns ``{"records", "state", "trainer", "out", "baseline", "wall_s", "stopped"}``.

    A user's mistake raises :class:`UsageError` (exit 2), a diverged run :class:`Diverged` (exit 3), a
    dropless MoE step over its stated exchange bound :class:`ExchangeOverflow` (exit 3),
    both after printing one line ``error: ...`` to stderr; a second Ctrl-C exits 130."""
    import meshdsl as md
    from meshdsl.models.training.checkpoint import CheckpointError

    try:
        args = parse_args(argv)
        _prepare_jax(args)
        try:
            return _run(args)
        except (md.MeshDSLError, CheckpointError) as e:
            raise UsageError(str(e)) from e
    except (UsageError, Diverged, ExchangeOverflow) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise
    except KeyboardInterrupt:
        print("interrupted: stopped at once, nothing saved since the last checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _run(args) -> dict:
    import jax
    import jax.numpy as jnp

    import meshdsl as md
    from meshdsl.models.data.batches import random_spans_helper
    from meshdsl.models.families.configs import get_config
    from meshdsl.models.training import faults, runinfo, runrecord
    from meshdsl.models.training.checkpoint import Checkpoints, latest_step, state_bytes
    from meshdsl.models.training.optim import DEFAULT_LR, default_warmup, family_of, make_optimizer
    from meshdsl.models.training.trainer import Feed, Trainer, host_metrics

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
        config = get_config(args.model).replace(vocab=vocab.size, **options.overrides(args.override))
    except TypeError as e:
        raise UsageError(f"--override: {e}; the model config's keys are "
                         f"{', '.join(sorted(get_config(args.model).__dict__))}") from e
    enc_len, dec_len = runinfo.lengths(args, random_spans_helper)
    if args.offload == "auto" and args.layout != "auto":
        raise UsageError("--offload auto is the layout search's choice: pass --layout auto (and --memory-budget), "
                         f"or name what to offload: --offload {', '.join(options.OFFLOAD)} (comma-separated)")
    options.offload_activations(args)
    if args.layout == "auto":
        from meshdsl.models.training import autolayout
        autolayout.choose_for_run(args, config, enc_len, dec_len, say,
                                  tx=make_optimizer(args.optimizer, family=family_of(config))[0])
    mesh = md.Mesh.parse(args.mesh)
    layout = md.Layout.parse(args.layout or _default_layout(config, mesh), args.params_layout)
    if args.microbatches or args.offload:
        layout = md.Layout(layout.rules, layout.param_rules, offload=args.offload.split(",") if args.offload else (),
                           microbatches={"batch": args.microbatches} if args.microbatches else None)
    layout.check_mesh(mesh)
    for warning in faults.mesh_warnings(mesh, layout):
        say(warning)
    try:
        Feed.check_batch(args.batch, args.accum, mesh, layout)
    except ValueError as e:
        raise UsageError(str(e)) from e
    lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    family = family_of(config)
    warmup = default_warmup(args.optimizer, args.steps, family) if args.warmup is None else args.warmup
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

    tx, schedule = make_optimizer(args.optimizer, lr, warmup, args.steps, args.decay, family=family)
    trainer = Trainer(config, mesh, layout, tx, schedule, seed=args.seed, accum=args.accum, remat=args.remat,
                      param_gather=args.param_gather, param_dtype=jnp.dtype(args.param_dtype),
                      dtype=jnp.dtype(args.dtype), debug_nan_at_step=args.debug_nan_at_step,
                      pipeline_schedule=args.schedule, repeats=args.repeats,
                      attention=None if args.attention == "auto" else args.attention,
                      memory_budget=args.memory_budget if args.remat == "auto" else None)
    _check_rules(trainer, args, enc_len, dec_len)
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

    from meshdsl.models.training.progress import jsonable
    from meshdsl.models.training.runloop import span_filling

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
    from meshdsl.models.families.family import is_decoder_only
    from meshdsl.models.training import runinfo, runrecord
    from meshdsl.models.training.faults import Preemption
    from meshdsl.models.training.progress import MetricsLog, ProgressBar, plot_losses
    from meshdsl.models.training.runloop import loop
    from meshdsl.models.training.trainer import Feed

    import jax

    lead = jax.process_index() == 0
    enc_len, dec_len = lengths
    data = dict(kind=args.task, encoder_length=enc_len, decoder_length=dec_len, seed=args.seed,
                text_files=args.text_files, vocab=vocab)
    feed = Feed(split="train", batch=args.batch, mesh=trainer.mesh, layout=trainer.layout, accum=args.accum,
                start_step=start, **data)
    baseline = runinfo.baselines(args, vocab, enc_len, dec_len)
    say(runinfo.summary(args, trainer.config, trainer.mesh, trainer.layout, enc_len, dec_len, baseline))
    first, report = next(feed), None
    if not args.no_explain:
        report = trainer.explain(state, first)
        say(runinfo.explain_text(report, args.accum))
    t0 = time.perf_counter()
    compiled = trainer.compile(state, first)
    say(f"compiled   one step in {time.perf_counter() - t0:.1f}s; {runinfo.hlo_text(compiled)}")
    for line in runinfo.transfers_text(trainer.transfers(state, report=report, accum=args.accum)):
        say(line)

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
                                           dec_len + (0 if is_decoder_only(trainer.config) else enc_len), log,
                                           bar, ckpts, stop, out, vocab)
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
        from meshdsl.models.hub import hf
        hf.save_pretrained(trainer.model(state["params"]), args.export_hf, vocab=vocab)
        say(f"exported   the model as a Hugging Face directory: {args.export_hf}")
    return {"records": records, "state": state, "trainer": trainer, "out": out, "baseline": baseline,
            "wall_s": wall, "stopped": stopped, "report": report}


def cli(argv=None) -> int:
    """``python -m meshdsl.models.train``: :func:`main`; a multi-process run under a supervisor
    (:mod:`meshdsl.models.training.supervisor`: a dead peer is one line, exit 4). Returns the exit status."""
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
