"""Export a training run's checkpoint as a Hugging Face directory.

    python -m meshdsl.models.export --run runs/t5-tiny --out hf/t5-tiny [--step N]

Reads the run's ``run.json`` (model config, optimizer, data), restores the checkpoint (the latest
intact one by default, verified against its manifest) on this machine's devices, and writes
``model.safetensors``, ``config.json`` and the run's sentencepiece model ``spiece.model`` with
:func:`meshdsl.models.hf.save_pretrained`; ``transformers``' ``from_pretrained`` loads the result.
"""

from __future__ import annotations

import argparse
import os
import sys

from meshdsl.models.training.faults import UsageError

__all__ = ["export_run", "main"]


def export_run(run: str, out: str, step: int | None = None) -> tuple[str, int]:
    """Write run ``run``'s checkpoint ``step`` (default: the latest) to ``out``; ``(out, step)``."""
    import jax
    import jax.numpy as jnp

    import meshdsl as md
    from meshdsl.models.data.corpus import load_vocabulary
    from meshdsl.models.families.configs import config_from_dict
    from meshdsl.models.hub import hf
    from meshdsl.models.training.checkpoint import Checkpoints, latest_step
    from meshdsl.models.training.optim import make_optimizer
    from meshdsl.models.training.runrecord import read_run
    from meshdsl.models.training.trainer import Trainer, host_metrics

    record = read_run(run)
    if record is None or "identity" not in record:
        raise UsageError(f"--run {run}: no run.json of a training run there (python -m meshdsl.models.train writes "
                         "it)")
    ckpt_dir = os.path.join(run, "checkpoints")
    if latest_step(ckpt_dir) is None:
        raise UsageError(f"--run {run}: no checkpoint under {ckpt_dir}")
    ident = record["identity"]
    config = config_from_dict(record["config"])
    tx, schedule = make_optimizer(ident["optimizer"], ident["lr"], ident["warmup"], ident["steps"], ident["decay"])
    mesh = md.Mesh({"data": len(jax.devices())})
    trainer = Trainer(config, mesh, md.Layout({}), tx, schedule, seed=ident.get("seed", 0),
                      param_dtype=jnp.dtype(ident.get("param_dtype") or "float32"))
    ckpts = Checkpoints(ckpt_dir, writable=False)
    try:
        state = ckpts.restore(trainer.abstract_state(), mesh, md.Layout({}), step)
    finally:
        ckpts.close()
    vocab = load_vocabulary(ident.get("text_files"))
    hf.save_pretrained(trainer.model(state["params"]), out, vocab=vocab)
    return out, int(host_metrics({"step": state["step"]})["step"])


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m meshdsl.models.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the training run's --out directory")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    args = p.parse_args(argv)
    from meshdsl.models.training.checkpoint import CheckpointError
    try:
        out, step = export_run(args.run, args.out, args.step)
    except (UsageError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported   step {step} of {args.run} to {out} (model.safetensors, config.json, the sentencepiece model)")
    return out


if __name__ == "__main__":
    main()
