"""Generate text with a trained run: ``python -m meshdsl.models.generate --run runs/t5-tiny --prompt "..."``.

Loads the run's model config (``run.json``), its latest checkpoint (``checkpoints/``) and its
sentencepiece vocabulary, encodes the prompt (eos appended, as in training), decodes with
:func:`meshdsl.models.generate` and prints the text (sentinels shown as ``<extra_id_i>``). A
decoder-only run (``--model llama-tiny``) continues the prompt instead: start token 0 (the start
of every training window) then the prompt's tokens, several prompts left-padded; it prints the
continuation::

    python -m meshdsl.models.generate --run runs/t5-tiny --prompt "In the beginning <extra_id_0> the earth"
    python -m meshdsl.models.generate --run runs/t5-tiny --prompt "..." --method beam --num-beams 4 \\
        --mesh data:2,model:4 --layout "heads:model;d_ff:model;vocab:model" --max-new-tokens 32
    python -m meshdsl.models.generate --run runs/llama-tiny --prompt "And God said" --max-new-tokens 24

:func:`span_filling_accuracy` measures span filling on validation batches (exact match of every
sentinel span, and of whole targets); the training loop can call it on its validation batches.

This module is the command line; ``meshdsl.models.generate`` stays the function (import from
here with ``from meshdsl.models.generate import main``).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from meshdsl.models.decoding.spans import span_filling_accuracy, split_spans

__all__ = ["main", "load_run", "encode_prompt", "span_filling_accuracy", "split_spans", "prompt_batch"]


def load_run(run_dir: str, mesh=None, layout=None):
    """``(model, vocab, run record)`` of a training run directory (latest checkpoint)."""
    import jax.numpy as jnp

    import meshdsl as md
    from meshdsl.models.data.corpus import load_vocabulary
    from meshdsl.models.families.configs import config_from_dict
    from meshdsl.models.training import checkpoint
    from meshdsl.models.training.optim import make_optimizer
    from meshdsl.models.training.trainer import Trainer

    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        raise SystemExit(f"{run_dir} is not a training run (no run.json); train one with python -m meshdsl.models.train")
    with open(path) as f:
        run = json.load(f)
    config = config_from_dict(run["config"])
    vocab = load_vocabulary(run.get("text_files"))
    if mesh is None:   # restore onto one device, replicated; generate() places it as it needs
        import jax
        mesh = md.Mesh({"data": 1}, devices=jax.devices()[:1])
    layout = layout or md.Layout({})
    tx, schedule = make_optimizer(run["optimizer"], run["lr"], run["warmup"], run["steps"], run["decay"])
    trainer = Trainer(config, mesh, layout, tx, schedule, param_dtype=jnp.dtype(run.get("param_dtype", "float32")))
    ckpt = os.path.join(run_dir, "checkpoints")
    if checkpoint.latest_step(ckpt) is None:
        raise SystemExit(f"no checkpoint under {ckpt}")
    state = checkpoint.restore(ckpt, trainer.abstract_state(), mesh, layout)
    return trainer.model(state["params"]), vocab, run


def encode_prompt(vocab, text: str) -> list[int]:
    """Token ids of ``text`` with ``<extra_id_i>`` as sentinel ids (span filling) and eos appended."""
    import re
    ids = []
    for k, piece in enumerate(re.split(r"<extra_id_(\d+)>", text)):
        if k % 2:
            ids.append(vocab.sentinel(int(piece)))
        elif piece.strip():
            ids += vocab.encode(piece.strip())
    return ids + [vocab.eos_id]


def prompt_batch(vocab, prompts, decoder_only: bool):
    """``(ids [batch, width], attention mask or None)``: T5 prompts (eos appended) right-padded
    with pad (its encoder masks them); decoder-only prompts ``[0, tokens...]`` left-padded with
    a mask of the real tokens (None when all have one length)."""
    if not decoder_only:
        rows = [encode_prompt(vocab, p) for p in prompts]
        width = max(map(len, rows))
        return np.array([r + [vocab.pad_id] * (width - len(r)) for r in rows], np.int32), None
    rows = [[0] + vocab.encode(p.strip()) for p in prompts]
    width = max(map(len, rows))
    ids = np.array([[vocab.pad_id] * (width - len(r)) + r for r in rows], np.int32)
    mask = np.array([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return ids, (None if mask.all() else mask)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meshdsl.models.generate",
                                description="Decode with the latest checkpoint of a training run.")
    a = p.add_argument
    a("--run", default="runs/t5-tiny", help="a training run directory (run.json, checkpoints/)")
    a("--prompt", action="append", required=True, help="input text (repeat for a batch)")
    a("--method", default="greedy", choices=("greedy", "sample", "beam"))
    a("--max-new-tokens", type=int, default=32)
    a("--num-beams", type=int, default=4)
    a("--temperature", type=float, default=1.0)
    a("--top-k", type=int, default=None)
    a("--top-p", type=float, default=None)
    a("--seed", type=int, default=0, help="sampling key")
    a("--mesh", default=None, help="e.g. data:2,model:4 (default: one device)")
    a("--layout", default=None, help="dim:axis rules for both phases, e.g. heads:model;d_ff:model")
    a("--prefill-layout", default=None, help="a different layout for the encoder pass")
    a("--cpu-devices", type=int, default=8, help="virtual CPU devices when there is no accelerator")
    return p


def main(argv=None) -> list[str]:
    """Run the CLI; returns the generated texts."""
    args = build_parser().parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if args.cpu_devices and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
    import jax

    import meshdsl as md
    from meshdsl.models.decoding.generation import generate

    mesh = md.Mesh.parse(args.mesh) if args.mesh else None
    model, vocab, _ = load_run(args.run, md.Mesh({"data": 1}, devices=jax.devices()[:1]), md.Layout({}))
    layout = md.Layout.parse(args.layout) if args.layout else (md.Layout({}) if mesh else None)
    if args.prefill_layout:
        layout = {"prefill": md.Layout.parse(args.prefill_layout), "decode": layout}
    decoder_only = bool(getattr(model.config, "decoder_only", False))
    ids, mask = prompt_batch(vocab, args.prompt, decoder_only)
    kw = {"attention_mask": mask} if mask is not None else {}
    if args.method == "sample":
        kw.update(key=jax.random.key(args.seed), temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    elif args.method == "beam":
        kw.update(num_beams=args.num_beams)
    out = generate(model, ids, max_new_tokens=args.max_new_tokens, method=args.method, eos_id=vocab.eos_id,
                   mesh=mesh, layout=layout, **kw)
    start = ids.shape[1] if decoder_only else 1      # a decoder-only output starts with the prompt
    texts = [vocab.decode(row[start:]) for row in np.asarray(out.array)]
    for prompt, text in zip(args.prompt, texts):
        print(f"{prompt}\n  -> {text}")
    return texts


if __name__ == "__main__":
    main()
