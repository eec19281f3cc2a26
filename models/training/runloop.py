"""The training loop of the CLI: steps, the finite check, logging, evaluation, checkpoints, preemption.

Every step's loss and gradient norm are checked on the host (one boolean, fetched while the next
batch is prepared): a NaN or inf stops the run with :class:`~meshdsl.models.training.faults.Diverged`
before that state can be saved, so orbax's rotation never replaces a good checkpoint with a bad
one. A SIGTERM / Ctrl-C (:class:`~meshdsl.models.training.faults.Preemption`) saves the state after the
step in flight and returns; in a multi-process run the processes agree on the stop first.
"""

from __future__ import annotations

import os
import time

import numpy as np

from meshdsl.models.training.faults import Diverged, ExchangeOverflow

__all__ = ["loop"]


def _fetch(x) -> np.ndarray:
    return np.asarray(x.addressable_data(0)) if hasattr(x, "addressable_data") else np.asarray(x)


def _agree(flag: bool) -> bool:
    """Whether any process raised ``flag`` (every process must call it; single process: ``flag``)."""
    import jax
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).max())


def _diverged(step: int, metrics: dict, ckpts, args) -> Diverged:
    values = {k: float(_fetch(metrics[k])) for k in ("loss", "grad_norm", "param_norm") if k in metrics}
    what = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in values.items())
    ckpts.wait()
    last = ckpts.latest_intact_step()
    where = (f"The last checkpoint, step {last} in {ckpts.directory}, is intact: resume from it with a lower "
             f"--lr (now {args.lr or 'the default'}) plus --resume --allow-changes" if last is not None
             else "no checkpoint was saved before it: start again with a lower --lr or more --warmup")
    return Diverged(f"step {step}: not finite ({what}); stopped without saving this state. {where}", step)


def _check_exchange(step: int, config, metrics: dict, args) -> None:
    """A dropless MoE model with a stated exchange bound stops on a step whose routing overflowed it."""
    bound = getattr(config, "exchange_factor", None)
    if bound is None or "moe/dropped_fraction" not in metrics:
        return
    dropped = float(_fetch(metrics["moe/dropped_fraction"]))
    if dropped > 0:
        raise ExchangeOverflow(
            f"step {step}: the routing sent some device more token assignments than exchange_factor={bound} "
            f"holds ({dropped:.2%} of them, given zeros); stopped without saving this state. Raise it (--override "
            f"exchange_factor={2 * bound:g}) or leave it unset (a buffer no routing overflows, more bytes per step)",
            step)


def span_filling(args, trainer, state, val_batches, vocab) -> dict:
    """``--eval-decode N``: greedy-decode N validation batches of a span-corruption run and score
    the sentinel spans (exact match), as ``val_span_exact_match`` / ``val_exact_match``."""
    if not args.eval_decode or args.task == "lm" or not val_batches:
        return {}
    from meshdsl.models.decoding.spans import span_filling_accuracy

    batches = [{k: np.asarray(v)[0] for k, v in b.items()} for b in val_batches[:args.eval_decode]]
    scores = span_filling_accuracy(trainer.model(state["params"]), batches, vocab,
                                   mesh=trainer.mesh, layout=trainer.layout)
    return {"val_span_exact_match": scores["span_exact_match"], "val_exact_match": scores["exact_match"]}


def loop(args, trainer, state, feed, batch, val_batches, start: int, tokens_per_row: int, log, bar, ckpts,
         stop, out: str, vocab=None):
    """Steps ``start+1 .. --steps``; ``(state, records, stopped)`` where ``stopped`` is the signal's
    name when a SIGTERM/SIGINT ended the run early (after saving), else None."""
    from meshdsl.models.training.trainer import host_metrics

    records, step = [], start
    t_last, s_last = time.perf_counter(), start
    profiling = False
    while step < args.steps:
        if args.profile_steps and step + 1 == args.profile_steps[0]:
            import jax
            jax.profiler.start_trace(os.path.join(out, "profile"))
            profiling = True
        state, metrics = trainer.step(state, batch)
        step += 1
        bar.advance()
        final = step == args.steps
        following = next(feed) if not final else None  # prepared while the step runs
        if not bool(_fetch(metrics["finite"])):  # waits for the step
            raise _diverged(step, metrics, ckpts, args)
        _check_exchange(step, trainer.config, metrics, args)
        if profiling and step == args.profile_steps[1]:
            import jax
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            profiling = False
            bar.print(f"profile    steps {args.profile_steps[0]}..{step} written to {os.path.join(out, 'profile')}")
        stopped = (stop.requested or "a signal to another process") if _agree(stop.requested is not None) else None
        evaluate = bool(val_batches) and ((args.eval_every and step % args.eval_every == 0) or final)
        if step % args.log_every == 0 or final or evaluate or stopped:
            record = {"step": step, **{k: v for k, v in host_metrics(metrics).items() if k != "finite"}}
            record["step_time_s"] = (time.perf_counter() - t_last) / (step - s_last)
            record["tokens_per_s"] = args.batch * tokens_per_row / record["step_time_s"]
            if evaluate:
                val = trainer.evaluate(state, val_batches)
                record.update({f"val_{k}": v for k, v in val.items() if k != "tokens"})
                record.update(span_filling(args, trainer, state, val_batches, vocab))
            records.append(record)
            log.write(record)
            bar.log(record)
            t_last, s_last = time.perf_counter(), step
        if (args.ckpt_every > 0 and step % args.ckpt_every == 0) or ((final or stopped) and args.ckpt_every >= 0):
            ckpts.save(step, state)
            t_last = time.perf_counter()
        if args.debug_signal and step == args.debug_signal[0]:  # tests: a signal at a known step
            os.kill(os.getpid(), args.debug_signal[1])
        if stopped:
            return state, records, stopped
        batch = following
    if profiling:
        import jax
        jax.profiler.stop_trace()
    return state, records, None
