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
and layout. Several processes (hosts) train one model: ``--coordinator host:port
--num-processes N --process-id I`` (or ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``); each process loads its share of every global batch.

The run loop lives here; the model, step and evaluation in :mod:`meshdsl.models.trainer`,
optimizers in :mod:`meshdsl.models.optim`, logging and plots in :mod:`meshdsl.models.progress`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import sys
import time

__all__ = ["main", "build_parser"]

DEFAULT_STEPS = 300


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: ...)" only where there is one worth showing
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meshdsl.models.train", formatter_class=_Help,
                                description="\n\n".join(__doc__.split("\n\n")[:3]).replace("``", ""))
    a = p.add_argument
    a("--model", default="t5-tiny", help="a name from meshdsl.models.configs.CONFIGS")
    a("--override", action="append", default=[], metavar="KEY=VALUE",
      help="change the model config, e.g. d_model=32,d_ff=64 (repeatable)")
    a("--mesh", default="data:-1", help="mesh axes, e.g. data:2,model:4 (-1: the remaining devices)")
    a("--layout", default=None, help="dim:axis rules; default batch:data (+ group:data;experts:data for MoE)")
    a("--params-layout", default=None, help="storage-only rules for parameters, e.g. d_model:data (ZeRO-3)")
    a("--task", default="span_corruption", choices=("span_corruption", "lm"),
      help="lm: the decoder learns to continue text (the encoder sees one EOS token)")
    a("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    a("--batch", type=int, default=32, help="global batch (sequences per step)")
    a("--encoder-length", type=int, default=128, help="encoder tokens per example (span corruption)")
    a("--decoder-length", type=int, default=None,
      help="default: span corruption's targets length for --encoder-length (29 for 128); lm: 64")
    a("--optimizer", default="adafactor", choices=("adafactor", "adamw"),
      help="adafactor: T5's (rsqrt schedule); adamw: clipping, warmup, cosine decay")
    a("--lr", type=float, default=None, help="peak learning rate (adafactor 1e-2, adamw 1e-3)")
    a("--warmup", type=int, default=None, help="warmup steps (adafactor: 10000, T5's; adamw: 5%% of --steps)")
    a("--decay", default="cosine", choices=("cosine", "rsqrt"), help="adamw's decay after warmup")
    a("--accum", type=int, default=1, help="gradient accumulation: microbatches per step")
    a("--remat", default="none", choices=("none", "full", "dots"),
      help="recompute each layer in the backward pass: nothing saved (full) or all but matmuls (dots)")
    a("--param-dtype", default="float32", choices=("float32", "bfloat16"), help="parameter storage dtype")
    a("--param-gather", default="keep", choices=("keep", "regather", "auto"),
      help="weights stored split (--params-layout): keep the gathered copy for the backward pass, gather again "
           "there, or auto: gather only where that moves fewer bytes than moving the activations")
    a("--seed", type=int, default=0, help="parameters, data order, span noise and dropout")
    a("--out", default=None, help="output directory (default runs/<model>)")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    a("--overwrite", action="store_true", help="start over in an --out that holds checkpoints (deletes them)")
    a("--eval-every", type=int, default=100, help="validation every N steps (0: only at the end)")
    a("--eval-batches", type=int, default=8, help="validation batches (fixed; 0: no validation)")
    a("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end; -1: never)")
    a("--log-every", type=int, default=10, help="metrics every N steps (tokens/s counts encoder + decoder "
      "positions, padding included)")
    a("--text-files", nargs="+", default=None, help="train on your own UTF-8 text (one document per line)")
    a("--no-explain", action="store_true", help="skip the md.explain communication report")
    a("--cpu-devices", type=int, default=8,
      help="virtual devices of the CPU platform (XLA_FLAGS), unless already set; ignored on GPU/TPU")
    a("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"), help="host:port of process 0")
    a("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"), help="processes in the run")
    a("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"), help="this process's index, 0 .. N-1")
    return p


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
            raise SystemExit("--coordinator needs --num-processes and --process-id "
                             "(or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def _overrides(items) -> dict:
    out = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise SystemExit(f"--override {pair!r}: write KEY=VALUE")
            try:
                out[key.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                out[key.strip()] = value.strip()
    return out


def _default_layout(config, mesh) -> str:
    axis = "data" if "data" in mesh.shape else mesh.axis_names[0]
    return f"batch:{axis}" + (f";group:{axis};experts:{axis}" if config.is_moe else "")


def main(argv=None) -> dict:
    """Run the CLI; returns ``{"records", "state", "trainer", "out", "baseline", "wall_s"}``."""
    args = build_parser().parse_args(argv)
    _prepare_jax(args)
    return _run(args)


def _run(args) -> dict:
    import jax
    import jax.numpy as jnp

    import meshdsl as md
    from meshdsl.models import checkpoint
    from meshdsl.models.configs import get_config
    from meshdsl.models.corpus import load_vocabulary
    from meshdsl.models.data import random_spans_helper
    from meshdsl.models.optim import make_optimizer
    from meshdsl.models.progress import MetricsLog, ProgressBar, plot_losses
    from meshdsl.models.trainer import Feed, Trainer, host_metrics

    t_start = time.perf_counter()
    lead = jax.process_index() == 0
    out = args.out or os.path.join("runs", args.model)
    ckpt_dir = os.path.join(out, "checkpoints")
    if not args.resume and checkpoint.latest_step(ckpt_dir) is not None:
        if not args.overwrite:
            raise SystemExit(f"{ckpt_dir} holds checkpoints: pass --resume to continue that run, --overwrite to "
                             "start over (deleting them), or choose another --out")
        if lead:
            shutil.rmtree(ckpt_dir)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("meshdsl.train: old checkpoints removed")
    vocab = load_vocabulary(args.text_files)
    config = get_config(args.model).replace(vocab=vocab.size, **_overrides(args.override))
    mesh = md.Mesh.parse(args.mesh)
    layout = md.Layout.parse(args.layout or _default_layout(config, mesh), args.params_layout)
    enc_len, dec_len = _lengths(args, random_spans_helper)
    data = dict(kind=args.task, encoder_length=enc_len, decoder_length=dec_len, seed=args.seed,
                text_files=args.text_files, vocab=vocab)
    Feed.check_batch(args.batch, args.accum, mesh, layout)
    val_batches = Feed(split="validation", batch=args.batch, mesh=mesh, layout=layout,
                       **data).take(args.eval_batches) if args.eval_batches > 0 else []
    tx, schedule = make_optimizer(args.optimizer, args.lr, args.warmup, args.steps, args.decay)
    trainer = Trainer(config, mesh, layout, tx, schedule, seed=args.seed, accum=args.accum, remat=args.remat,
                      param_gather=args.param_gather, param_dtype=jnp.dtype(args.param_dtype))
    start = 0
    if args.resume and checkpoint.latest_step(ckpt_dir) is not None:
        state = checkpoint.restore(ckpt_dir, trainer.abstract_state(), mesh, layout)
        start = int(host_metrics({"step": state["step"]})["step"])
    else:
        state = trainer.init_state()

    feed = Feed(split="train", batch=args.batch, mesh=mesh, layout=layout, accum=args.accum, start_step=start,
                **data)
    baseline = _baselines(args, vocab, enc_len, dec_len)
    say = print if lead else (lambda *a, **k: None)
    say(_summary(args, config, mesh, layout, enc_len, dec_len, baseline))
    first = next(feed)
    if not args.no_explain:
        say(_explain_text(trainer.explain(state, first), args.accum))
    t0 = time.perf_counter()
    compiled = trainer.compile(state, first)
    say(f"compiled   one step in {time.perf_counter() - t0:.1f}s; {_hlo_text(compiled)}")

    os.makedirs(out, exist_ok=True)
    if lead:
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump({**vars(args), "config": config.__dict__, "layout": str(layout), "mesh": str(mesh),
                       **baseline}, f, indent=1, default=str)
    log = MetricsLog(os.path.join(out, "metrics.jsonl"), resume_step=start if args.resume else None, enabled=lead)
    bar = ProgressBar(args.steps, start, enabled=lead)
    if start:
        bar.print(f"resumed from step {start} ({ckpt_dir})")
    elif args.resume:
        bar.print(f"no checkpoint in {ckpt_dir}: starting from step 0")
    try:
        state, records = _loop(args, trainer, state, feed, first, val_batches, start, enc_len + dec_len, log, bar,
                               ckpt_dir)
    finally:
        bar.close()
    wall = time.perf_counter() - t_start
    title = f"{config.name} · {mesh} · {layout}"
    if lead and os.path.exists(log.path) and not plot_losses(log.path, os.path.join(out, "loss.png"),
                                                             baseline["target_unigram_entropy"], title):
        say("(no loss.png: pip install matplotlib)")
    if records:
        last = records[-1]
        val = (f", validation loss {last['val_loss']:.3f} vs unigram baseline "
               f"{baseline['target_unigram_entropy']:.3f}") if "val_loss" in last else ""
        say(f"done       {args.steps - start} steps in {wall:.0f}s: loss {last['loss']:.3f}{val}; written to {out}")
    else:
        say(f"done       the checkpoint is at step {start} >= --steps {args.steps}: nothing to train")
    return {"records": records, "state": state, "trainer": trainer, "out": out, "baseline": baseline,
            "wall_s": wall}


def _loop(args, trainer, state, feed, batch, val_batches, start: int, tokens_per_row: int, log, bar, ckpt_dir):
    """Steps ``start+1 .. --steps``: log, evaluate and checkpoint on schedule; ``(state, records)``."""
    from meshdsl.models import checkpoint
    from meshdsl.models.trainer import host_metrics

    records, step = [], start
    t_last, s_last = time.perf_counter(), start
    while step < args.steps:
        state, metrics = trainer.step(state, batch)
        step += 1
        bar.advance()
        final = step == args.steps
        evaluate = bool(val_batches) and ((args.eval_every and step % args.eval_every == 0) or final)
        if step % args.log_every == 0 or final or evaluate:
            record = {"step": step, **host_metrics(metrics)}  # waits for the step
            record["step_time_s"] = (time.perf_counter() - t_last) / (step - s_last)
            record["tokens_per_s"] = args.batch * tokens_per_row / record["step_time_s"]
            if evaluate:
                val = trainer.evaluate(state, val_batches)
                record.update({f"val_{k}": v for k, v in val.items() if k != "tokens"})
            records.append(record)
            log.write(record)
            bar.log(record)
            t_last, s_last = time.perf_counter(), step
        if (args.ckpt_every > 0 and step % args.ckpt_every == 0) or (final and args.ckpt_every >= 0):
            checkpoint.save(ckpt_dir, step, state)
            t_last = time.perf_counter()
        if not final:
            batch = next(feed)  # prepared while the step runs
    return state, records


def _summary(args, config, mesh, layout, enc_len: int, dec_len: int, baseline: dict) -> str:
    import jax

    from meshdsl.models.t5 import count_params

    experts = f", {config.num_experts} experts" if config.is_moe else ""
    return "\n".join([
        f"model      {config.name}: {count_params(config) / 1e6:.2f}M parameters (d_model {config.d_model}, d_ff "
        f"{config.d_ff}, heads {config.heads}x{config.d_kv}, layers {config.encoder_layers}+{config.decoder_layers}"
        f"{experts}, vocab {config.vocab})",
        f"mesh       {mesh} over {len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)",
        f"layout     {layout}  (param_gather={args.param_gather}, remat={args.remat})",
        f"data       {args.task}, batch {args.batch} x (encoder {enc_len}, decoder {dec_len}), accum {args.accum}"
        f"; optimizer {args.optimizer}",
        f"baseline   validation split: unigram entropy {baseline['unigram_entropy']:.3f} nats/token, a unigram "
        f"model fitted on train scores {baseline['unigram_cross_entropy']:.3f};",
        f"           on the validation targets ({args.task}) the unigram entropy is "
        f"{baseline['target_unigram_entropy']:.3f}: val_loss must fall clearly below it"])


def _baselines(args, vocab, enc_len: int, dec_len: int) -> dict:
    """Unigram entropies (nats/token) a model must beat: of the validation split's tokens, of a
    unigram model fitted on train, and of the validation *targets* of this task (span corruption's
    targets include the easy sentinels and EOS, so that is the one in val_loss's units)."""
    import numpy as np

    from meshdsl.models.corpus import corpus_tokens, unigram_cross_entropy, unigram_entropy
    from meshdsl.models.data import make_dataset

    val = corpus_tokens(vocab, "validation", args.text_files)
    train = corpus_tokens(vocab, "train", args.text_files)
    batches = make_dataset(args.task, "validation", args.batch, enc_len, dec_len, args.seed,
                           text_files=args.text_files, vocab=vocab)
    targets = np.concatenate([b["decoder_target_tokens"][b["decoder_loss_weights"] > 0] for b in batches])
    return {"unigram_entropy": unigram_entropy(val),
            "unigram_cross_entropy": unigram_cross_entropy(train, val, vocab.size),
            "target_unigram_entropy": unigram_entropy(targets)}


def _lengths(args, random_spans_helper) -> tuple[int, int]:
    if args.task == "lm":
        return 1, args.decoder_length or 64
    return args.encoder_length, args.decoder_length or random_spans_helper(args.encoder_length)[1]


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _explain_text(report, accum: int) -> str:
    """The communication of one step by kind, from md.explain (one microbatch, times ``accum``)."""
    lines = [f"explain    one training step (forward + backward{f', x{accum} microbatches' if accum > 1 else ''})"
             f": {_fmt_bytes(report.total_bytes * accum)} per device, "
             f"{report.flops * accum / 1e9:.2f} GFLOP per device, memory {_fmt_bytes(report.memory['peak'])}"]
    summary = report.summary()
    if not summary:
        lines.append("           no communication")
    for kind, row in summary.items():
        phases = {}
        for r in report.collectives:
            if r.kind == kind:
                phases[r.phase] = phases.get(r.phase, 0) + r.total_bytes
        split = ", ".join(f"{p} {_fmt_bytes(b * accum)}" for p, b in phases.items())
        lines.append(f"           {kind:<16} x{row['count'] * accum:<5} {_fmt_bytes(row['bytes'] * accum):>11}"
                     f"   ({split})")
    return "\n".join(lines)


def _hlo_text(compiled) -> str:
    from meshdsl import hlo_comm
    rep = hlo_comm.analyze(compiled)
    kinds = ", ".join(f"{k} x{v['count']}" for k, v in rep.summary().items())
    return (f"the compiled step (with the optimizer update) moves {_fmt_bytes(rep.total_moved_bytes())} "
            f"per device ({kinds or 'no collectives'})")


if __name__ == "__main__":
    main()
    sys.exit(0)
