"""What the training CLI prints about a run before it trains: the summary, the data baselines,
``md.explain``'s communication of one step and the compiled step's own count."""

from __future__ import annotations

from meshdsl.names.units import fmt_bytes

__all__ = ["summary", "baselines", "explain_text", "hlo_text", "lengths"]


def summary(args, config, mesh, layout, enc_len: int, dec_len: int, baseline: dict) -> str:
    import jax

    from meshdsl.models.families.family import describe, is_decoder_only

    if is_decoder_only(config):   # one stack: no encoder
        data = f"{args.task} (next-token prediction), batch {args.batch} x {dec_len} tokens"
    else:
        data = f"{args.task}, batch {args.batch} x (encoder {enc_len}, decoder {dec_len})"
    attention = "" if getattr(args, "attention", "auto") == "auto" else f", attention={args.attention}"
    return "\n".join([
        f"model      {describe(config)}",
        f"mesh       {mesh} over {len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)",
        f"layout     {layout}  (param_gather={args.param_gather}, remat={args.remat}{attention}, compute {args.dtype}, "
        f"parameters {args.param_dtype})",
        f"data       {data}, accum {args.accum}; optimizer {args.optimizer}",
        f"baseline   validation split: unigram entropy {baseline['unigram_entropy']:.3f} nats/token, a unigram "
        f"model fitted on train scores {baseline['unigram_cross_entropy']:.3f};",
        f"           on the validation targets ({args.task}) the unigram entropy is "
        f"{baseline['target_unigram_entropy']:.3f}: val_loss must fall clearly below it"])


def baselines(args, vocab, enc_len: int, dec_len: int) -> dict:
    """Unigram entropies (nats/token) a model must beat: of the validation split's tokens, of a
    unigram model fitted on train, and of the validation *targets* of this task (span corruption's
    targets include the easy sentinels and EOS, so that is the one in val_loss's units)."""
    import numpy as np

    from meshdsl.models.data.batches import make_dataset
    from meshdsl.models.data.corpus import corpus_tokens, unigram_cross_entropy, unigram_entropy

    val = corpus_tokens(vocab, "validation", args.text_files)
    train = corpus_tokens(vocab, "train", args.text_files)
    batches = make_dataset(args.task, "validation", args.batch, enc_len, dec_len, args.seed,
                           text_files=args.text_files, vocab=vocab)
    targets = np.concatenate([b["decoder_target_tokens"][b["decoder_loss_weights"] > 0] for b in batches])
    return {"unigram_entropy": unigram_entropy(val),
            "unigram_cross_entropy": unigram_cross_entropy(train, val, vocab.size),
            "target_unigram_entropy": unigram_entropy(targets)}


def lengths(args, random_spans_helper) -> tuple[int, int]:
    if args.task == "lm":
        return 1, args.decoder_length or 64
    return args.encoder_length, args.decoder_length or random_spans_helper(args.encoder_length)[1]


def explain_text(report, accum: int) -> str:
    """The communication of one step by kind, from md.explain (one microbatch, times ``accum``)."""
    lines = [f"explain    one training step (forward + backward{f', x{accum} microbatches' if accum > 1 else ''})"
             f": {fmt_bytes(report.total_bytes * accum)} per device, "
             f"{report.flops * accum / 1e9:.2f} GFLOP per device, memory {fmt_bytes(report.memory['peak'])}"]
    for p in (report.pipeline or {}).get("each", [report.pipeline] if report.pipeline else []):
        schedule = p["schedule"] + (f", {p['repeats']} repeats" if "repeats" in p else "")
        lines.append(f"           pipeline ({schedule}) over {p['axis']}: {p['stages']} stages, {p['microbatches']} "
                     f"microbatches, {p['ticks']} ticks, bubble {p['bubble_fraction']:.0%}")
    summary = report.summary()
    if not summary:
        lines.append("           no communication")
    for kind, row in summary.items():
        phases = {}
        for r in report.collectives:
            if r.kind == kind:
                phases[r.phase] = phases.get(r.phase, 0) + r.total_bytes
        split = ", ".join(f"{p} {fmt_bytes(b * accum)}" for p, b in phases.items())
        lines.append(f"           {kind:<16} x{row['count'] * accum:<5} {fmt_bytes(row['bytes'] * accum):>11}"
                     f"   ({split})")
    return "\n".join(lines)


def hlo_text(compiled) -> str:
    from meshdsl.costmodel import hlo_comm
    rep = hlo_comm.analyze(compiled)
    kinds = ", ".join(f"{k} x{v['count']}" for k, v in rep.summary().items())
    return (f"the compiled step (with the optimizer update) moves {fmt_bytes(rep.total_moved_bytes())} "
            f"per device ({kinds or 'no collectives'})")


def transfers_text(transfers) -> list[str]:
    """One line per host <-> device transfer of a step (:meth:`Trainer.transfers`)."""
    return [f"offload    {t['what']} {t['direction']}: {fmt_bytes(t['bytes'])} per device each step "
            f"(~{t['seconds'] * 1e3:.2f} ms on the host link)" for t in transfers]
