"""Model programs for the benchmarks: one training step (loss and gradients) of a t5-small-shaped
model and of an MoE-T5, with reduced depth, under the layouts the benchmarks compare.

Each case also carries the analytic minimum of the bytes a device must send, where a closed form
exists (see :func:`minimum`); ``None`` where it does not.
"""

from __future__ import annotations

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.models.configs import get_config  # noqa: E402
from meshdsl.models.loss import t5_loss  # noqa: E402
from meshdsl.models.t5 import T5  # noqa: E402

F32 = 4
MEGATRON = {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}

AUTO = "param_gather=auto: "  # rows lowered with md.lower(..., param_gather="auto")


def lower_kwargs(name: str) -> dict:
    return {"param_gather": "auto"} if name.startswith(AUTO) else {}


DENSE_CASES = {
    "data parallel": ("data:8", {"batch": "data"}, None),
    "Megatron": ("data:2;model:4", MEGATRON, None),
    "Megatron + sequence parallel": ("data:2;model:4", {**MEGATRON, "length": "model"}, None),
    "ZeRO-3": ("data:8", {"batch": "data"}, {"d_model": "data"}),
    "Megatron + ZeRO-3": ("data:2;model:4", MEGATRON, {"d_model": "data"}),
    AUTO + "ZeRO-3": ("data:8", {"batch": "data"}, {"d_model": "data"}),
    AUTO + "Megatron + ZeRO-3": ("data:2;model:4", MEGATRON, {"d_model": "data"}),
    "2-D weight-stationary": ("data:2;model:4", {"d_model": "data", "d_ff": "model", "heads": "model"}, None),
}
MOE_CASES = {
    "data parallel": ("data:8", {"batch": "data", "group": "data"}, None),
    "expert parallel": ("data:8", {"batch": "data", "group": "data", "experts": "data"}, None),
    "expert parallel + Megatron": ("data:2;model:4", {**MEGATRON, "group": "data", "experts": "data"}, None),
    "expert parallel + ZeRO-3 (dense)": ("data:8", {"batch": "data", "group": "data", "experts": "data"},
                                         {"d_kv": "data"}),
}


def config(kind: str, layers: int = 2, quick: bool = True):
    """t5-small's widths (8 heads, so Megatron splits them 4 ways; MoE-T5: 8 experts on them),
    ``layers`` encoder and decoder layers."""
    c = get_config("t5-small").replace(encoder_layers=layers, decoder_layers=layers, dropout_rate=0.0)
    if kind == "moe":
        c = c.replace(num_experts=8, expert_d_ff=c.d_ff, moe_every=2)
    return c


def shapes(quick: bool):
    return dict(batch=8, enc=64, dec=16) if quick else dict(batch=16, enc=256, dec=64)


def batch_for(cfg, batch: int, enc: int, dec: int, abstract: bool = False):
    r = np.random.RandomState(0)
    arrays = {"encoder_input_tokens": r.randint(1, cfg.vocab, (batch, enc)),
              "decoder_input_tokens": r.randint(1, cfg.vocab, (batch, dec)),
              "decoder_target_tokens": r.randint(1, cfg.vocab, (batch, dec)),
              "decoder_loss_weights": np.ones((batch, dec), np.float32)}
    return {k: md.named(jax.ShapeDtypeStruct(v.shape, v.dtype) if abstract else jnp.asarray(v),
                        "batch inputs" if k.startswith("encoder") else "batch targets")
            for k, v in arrays.items()}


def train_step(model, batch):
    """Loss and gradients of one step (no dropout: deterministic, cheap to compile)."""
    def loss_fn(m):
        loss, _ = t5_loss(m, batch, train=True)
        return loss.array
    return nnx.value_and_grad(loss_fn)(model)


def build(cfg, abstract: bool = False):
    if abstract:
        return nnx.eval_shape(lambda: T5(cfg, rngs=nnx.Rngs(0)))
    return T5(cfg, rngs=nnx.Rngs(0))


def param_leaves(model):
    return jax.tree_util.tree_leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, md.NamedArray))


def local_param_bytes(model, mesh, layout, axes_to_ignore=()) -> float:
    """Bytes of one device's block of every parameter under the compute layout (storage rules off),
    counting splits over ``mesh`` axes except ``axes_to_ignore``."""
    total = 0.0
    for p in param_leaves(model):
        n = 1
        for d in p.dims:
            for a in layout.axes(d.name):
                if a not in axes_to_ignore:
                    n *= mesh.shape[a]
        total += p.size / n * F32
    return total


def minimum(name: str, kind: str, cfg, model, mesh, layout, s: dict) -> tuple[float | None, str]:
    """Analytic minimum bytes per device, and the formula, for one training step.

    Gradients of parameters replicated over ``data`` (n_d devices) must be summed over it:
    ``2(n_d-1)/n_d * 4 * sum(local params)`` (ZeRO-3: all-gather + reduce-scatter, the same bytes).
    Megatron over ``model`` (n_m): every sub-layer's output is a partial sum over the split heads or
    d_ff (one all-reduce forward), and its input cotangent is one all-reduce backward; the embedding
    lookups over a split vocab are partial sums (forward); the decoder's cross-attention input
    (the encoder output) one all-reduce backward for all layers; the logits' input one backward;
    the loss: three all-reduces of [B/n_d, L_dec] statistics (max, sum, target logit).
    """
    n_d = mesh.shape.get("data", 1)
    n_m = mesh.shape.get("model", 1)
    dp = 2 * (n_d - 1) / n_d * local_param_bytes(model, mesh, layout, axes_to_ignore=("data",))
    loss_scalar = 2 * (n_d - 1) / n_d * F32
    if name in ("data parallel", "ZeRO-3") and kind == "dense" or name == "data parallel":
        return dp + loss_scalar, "2(n-1)/n * 4 * P (gradient sum) + loss"
    if kind == "dense" and name in ("Megatron", "Megatron + ZeRO-3", "Megatron + sequence parallel"):
        b = s["batch"] // n_d
        a_e, a_d = b * s["enc"] * cfg.d_model * F32, b * s["dec"] * cfg.d_model * F32
        ar = lambda nbytes: 2 * (n_m - 1) / n_m * nbytes  # noqa: E731
        forward = ar(a_e) * (1 + 2 * cfg.encoder_layers) + ar(a_d) * (1 + 3 * cfg.decoder_layers)
        backward = ar(a_e) * (2 * cfg.encoder_layers + 1) + ar(a_d) * (3 * cfg.decoder_layers + 1)
        stats = 3 * ar(b * s["dec"] * F32)
        return forward + backward + stats + dp + loss_scalar, \
            "AR_m(act) per sub-layer fwd+bwd, embeddings, encoder output, logits input; 3 AR_m(stats); DP"
    return None, "-"


def cases(kind: str, quick: bool = True, layers: int = 2):
    """(name, mesh, layout, fn, args, minimum, formula) for the model training steps."""
    cfg = config(kind, layers, quick)
    s = shapes(quick)
    table = DENSE_CASES if kind == "dense" else MOE_CASES
    model = build(cfg)
    batch = batch_for(cfg, s["batch"], s["enc"], s["dec"])
    out = []
    for name, (mesh_spec, rules, params) in table.items():
        mesh = md.Mesh.parse(mesh_spec)
        layout = md.Layout(rules, params=params)
        lo, formula = minimum(name, kind, cfg, model, mesh, layout, s)
        out.append((name, mesh, layout, train_step, (model, batch), lo, formula))
    return out
