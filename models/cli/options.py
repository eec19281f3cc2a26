"""The training CLI's options (``python -m meshdsl.models.train``): the parser, the value types
(checked at parse time, the same for a ``--config`` file), ``--override`` pairs, and the defaults
that depend on the model's family: a decoder-only model (``llama-*``) trains ``--task lm`` with
AdamW (:data:`meshdsl.models.training.optim.ADAMW`), T5 / MoE-T5 span corruption with Adafactor."""

from __future__ import annotations

import argparse
import ast
import os
import sys

import meshdsl as md
from meshdsl.models.families.configs import MODELS
from meshdsl.models.training import runrecord
from meshdsl.models.training.faults import UsageError
from meshdsl.models.training.optim import DEFAULT_OPTIMIZER, family_of

__all__ = ["build_parser", "parse_args", "overrides", "DEFAULT_STEPS", "DEFAULT_CKPT_EVERY"]

DEFAULT_STEPS = 300
DEFAULT_CKPT_EVERY = 100
ATTENTION = ("auto", "gather", "ring", "ulysses")   # --attention: auto, or one of md.attention's strategies


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: ...)" only where there is one worth showing
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)



OFFLOAD = (*md.OFFLOAD, "activations")   # --offload's names: a layout's storage, and the layers' residuals


def _offload(text: str) -> str:
    """``--offload``: ``auto`` or names of :data:`OFFLOAD`, comma-separated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if text == "auto" or (names and all(n in OFFLOAD for n in names)):
        return text if text == "auto" else ",".join(names)
    raise argparse.ArgumentTypeError(f"{text!r}: name what to keep in host memory, comma-separated, from "
                                     f"{', '.join(OFFLOAD)}; or auto (with --layout auto)")

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
    """A remat policy of meshdsl.layers (a name, or value names to keep), checked at parse time;
    ``auto``: the planner's choice (or the search's, with ``--layout auto``)."""
    from meshdsl.layers.stack import remat_policy
    if text == "auto":
        return text
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


def _env_int(name: str):
    value = os.environ.get(name)
    return int(value) if value else None


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The parser; ``description`` heads ``--help`` (the CLI module's docstring)."""
    p = argparse.ArgumentParser(prog="python -m meshdsl.models.train", formatter_class=_Help,
                                description=description)
    a = p.add_argument
    a("--config", dest="config_file", default=None, metavar="FILE",
      help="YAML or JSON file of options (the keys of a run's run.json); flags given here win")
    a("--model", default="t5-tiny", choices=sorted(MODELS), metavar="MODEL",
      help=f"one of: {', '.join(sorted(MODELS))} (t5-*: T5; moe-t5-*, switch-*: MoE-T5; llama-*: the "
           "decoder-only Llama, trained with --task lm and AdamW by default; mixtral-*, qwen2-moe-*: Llama with "
           "dropless experts)")
    a("--override", action="append", default=[], metavar="KEY=VALUE",
      help="change the model config, e.g. d_model=32,d_ff=64 (repeatable)")
    a("--mesh", default="data:-1", help="mesh axes, e.g. data:2,model:4 (-1: the remaining devices)")
    a("--layout", default=None,
      help="dim:axis rules, each naming a dim of the model (Megatron: heads:model;d_ff:model;vocab:model on T5, "
           "kv_heads:model;d_ff:model;vocab:model on Llama; context parallelism: length:ctx, the attention's own "
           "seq:ctx;kv_seq:ctx too to split its positions everywhere); default batch:data (+ "
           "group:data;experts:data for MoE-T5, experts:data for the MoE decoders); auto: md.search ranks the layouts of the training step (over the "
           "device count, or the --mesh given) and the run takes the best")
    a("--memory-budget", default=None, metavar="SIZE",
      help="--layout auto: bytes per device a layout may use, e.g. 12GiB (default: the --hardware's memory); "
           "--remat auto: what the training step's plan may hold per device (default: no limit)")
    a("--hardware", default="measure", metavar="NAME",
      help="--layout auto: the time model's device, a profile (h100-80gb, tpu-v5p, ...) or measure (this "
           "machine's speeds, fitted in a few seconds)")
    a("--params-layout", default=None, help="storage-only rules for parameters, e.g. d_model:data (ZeRO-3)")
    a("--offload", default=None, type=_offload,
      help="keep in host memory between steps (comma-separated): optimizer (the optimizer state, split as its "
           "parameter is stored; brought to the device for the update and sent back each step); params (the "
           "parameters: each layer's brought to the device while the layer before runs, forward and backward, its "
           "gradient sent back, the update on the device); activations (what each layer keeps for its backward pass, "
           "in host memory until then: --remat offload); auto (with --layout auto): "
           "the search keeps each layout's optimizer state on the device where it fits --memory-budget, else "
           "in host memory, paying its trip over the host link")
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
    a("--attention", default="auto", choices=ATTENTION,
      help="md.attention's context parallelism where the layout splits the attention's positions (e.g. "
           "length:ctx;seq:ctx;kv_seq:ctx): gather (keys and values all-gathered), ring (rotated by ppermute, one "
           "chunk per device at a time), ulysses (all-to-alls move the split to the heads), auto: the planner's "
           "choice by bytes")
    a("--task", default="span_corruption", choices=("span_corruption", "lm"),
      help="lm: the decoder learns to continue text (T5's encoder sees one EOS token); decoder-only models "
           "(llama-*) train with lm, their default")
    a("--steps", type=POSITIVE, default=DEFAULT_STEPS, help="optimizer steps")
    a("--batch", type=POSITIVE, default=32, help="global batch (sequences per step)")
    a("--encoder-length", type=_TYPES["encoder_length"], default=128,
      help="encoder tokens per example (span corruption)")
    a("--decoder-length", type=POSITIVE, default=None,
      help="default: span corruption's targets length for --encoder-length (29 for 128); lm: 64")
    a("--optimizer", default="adafactor", choices=("adafactor", "adamw"),
      help="adafactor: T5's (rsqrt schedule), the default of T5 / MoE-T5; adamw: clipping at 1.0, linear warmup, "
           "cosine decay to 10%% of --lr, the default of llama-*, with Llama's b1 0.9, b2 0.95, weight decay 0.1 "
           "(T5's: b2 0.98, weight decay 0.01) (default: %(default)s; adamw for llama-*)")
    a("--lr", type=_positive_float, default=None, help="peak learning rate (adafactor 1e-2, adamw 1e-3)")
    a("--warmup", type=NATURAL, default=None,
      help="warmup steps (adafactor: 10000, T5's; adamw: 5%% of --steps, for Llama at most 2000, Llama 2's)")
    a("--decay", default="cosine", choices=("cosine", "rsqrt"), help="adamw's decay after warmup")
    a("--accum", type=POSITIVE, default=1, help="gradient accumulation: microbatches per step")
    a("--remat", type=_remat, default="none",
      help="what each layer keeps for the backward pass (the rest is recomputed): none (keep all), full "
           "(keep nothing), dots, einsums, collectives (never communicate again), sequence-parallel (gather "
           "the sequence shard again), offload (keep all in host memory), offload-dots (the matmuls in host "
           "memory), or value names to keep: einsum,all-reduce,all-gather,...; auto: the planner chooses "
           "none, dots or full (on a GPU/TPU also offload, offload-dots) per layer stack, the fastest within "
           "--memory-budget (with --layout auto, the search chooses it with the layout)")
    a("--dtype", default="float32", choices=("float32", "bfloat16"),
      help="compute dtype: bfloat16 casts the parameters at use; gradients, parameters and optimizer state "
           "stay in --param-dtype")
    a("--param-dtype", default="float32", choices=("float32", "bfloat16"), help="parameter storage dtype")
    a("--param-gather", default="keep", choices=("keep", "regather", "auto"),
      help="weights stored split (--params-layout): keep the gathered copy for the backward pass, gather again "
           "there, or auto: the plan's choice, per weight, by the step's time within --memory-budget")
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
    a("--log-every", type=POSITIVE, default=10, help="metrics every N steps (tokens/s counts the positions of each "
      "stack, T5's encoder + decoder, padding included)")
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


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """The CLI's options: the command line over a ``--config`` file over the defaults, checked."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    chosen = _given(argv, description)   # the options on the command line
    if args.config_file:
        values = _checked(runrecord.config_file_defaults(args.config_file, parser), f"--config {args.config_file}")
        chosen |= set(values)
        parser.set_defaults(**values)
        args = parser.parse_args(argv)
        if args.model not in MODELS:
            raise UsageError(f"--config {args.config_file}: unknown model {args.model!r}; one of "
                             f"{', '.join(sorted(MODELS))}")
    elif args.eval_only:  # the run's data, unless the command line says otherwise
        out = args.out or os.path.join("runs", args.model)
        values = _checked(runrecord.data_defaults(out), os.path.join(out, "run.json"))
        chosen |= set(values)
        parser.set_defaults(**values)
        args = parser.parse_args(argv)
    _family_defaults(args, chosen)
    if args.resume_from is not None:
        args.resume = True
    if args.eval_only and args.resume:
        args.resume = False  # --eval-only --resume-from STEP: which step to evaluate
    return args


def _family_defaults(args, chosen: set) -> None:
    """The model family's defaults for the options not ``chosen`` (on the command line or in a
    file): a decoder-only model (Llama) learns ``--task lm`` (span corruption is refused) with AdamW."""
    if not getattr(MODELS[args.model], "decoder_only", False):
        return
    if args.task == "span_corruption":
        if "task" in chosen:
            raise UsageError(f"--model {args.model} is decoder-only: it trains with --task lm (next-token prediction, "
                             "its default), not span_corruption (an encoder-decoder task): pass --task lm or leave "
                             "--task out")
        args.task = "lm"
    if "optimizer" not in chosen:
        args.optimizer = DEFAULT_OPTIMIZER[family_of(MODELS[args.model])]


def _given(argv, description: str) -> set[str]:
    """The options the command line gives (parsed again with every default None)."""
    parser = build_parser(description)
    parser.set_defaults(**{a.dest: None for a in parser._actions})
    return {dest for dest, value in vars(parser.parse_args(argv)).items() if value is not None}


def _checked(values: dict, source: str) -> dict:
    """Option values from a file, checked like the command line's (UsageError naming ``source``)."""
    for dest, value in values.items():
        if dest in _TYPES and value is not None:
            try:
                values[dest] = _TYPES[dest](str(value))
            except argparse.ArgumentTypeError as e:
                raise UsageError(f"{source}: {dest}: {e}") from None
    return values


def offload_activations(args) -> None:
    """``--offload activations``: the layers' residuals in host memory (``--remat offload``); the
    rest of ``--offload`` stays the layout's storage."""
    names = (args.offload or "").split(",")
    if "activations" not in names:
        return
    if args.remat not in ("none", "offload"):
        raise UsageError(f"--offload activations keeps everything each layer saves for its backward pass in host "
                         f"memory (--remat offload), which --remat {args.remat} decides otherwise: drop one of them")
    args.remat = "offload"
    args.offload = ",".join(n for n in names if n != "activations") or None


def overrides(items) -> dict:
    """``--override`` values: ``KEY=VALUE`` pairs (comma-separated, repeatable), Python literals or text."""
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
