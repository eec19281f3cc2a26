"""The mixture-of-experts decoders of Hugging Face: ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``.

:mod:`meshdsl.models.hub.hf_llama` imports and exports them as it does Llama (the attention, norms,
embeddings and head have Llama's names); this module holds what differs: the configs and the
names of the experts. Every layer is sparse (our :class:`~meshdsl.layers.DroplessMoE`):

    Mixtral (model_type "mixtral")                     ours, inside layers.ffn
    block_sparse_moe.gate.weight          [E, d]       router.kernel             [d_model, expert_choice]
    block_sparse_moe.experts.e.w1.weight  [d_ff, d]    experts.wi_0.kernel[e]    [d_model, d_ff]   (gate)
    block_sparse_moe.experts.e.w3.weight  [d_ff, d]    experts.wi_1.kernel[e]    [d_model, d_ff]   (up)
    block_sparse_moe.experts.e.w2.weight  [d, d_ff]    experts.wo.kernel[e]      [d_ff, d_model]   (down)

    Qwen2-MoE (model_type "qwen2_moe")
    mlp.gate.weight                       [E, d]       router.kernel
    mlp.experts.e.{gate,up,down}_proj.weight           experts.{wi_0,wi_1,wo}.kernel[e]
    mlp.shared_expert.{gate,up,down}_proj.weight       shared.{wi_0,wi_1,wo}.kernel   [d_model, d_shared] ...
    mlp.shared_expert_gate.weight         [1, d]       shared_gate.kernel        [d_model, shared_gate:1]
    self_attn.{q,k,v}_proj.bias                        attention.{q,k,v}_bias    (``qkv_bias``)

Our config says which of the two it is: a shared expert (``shared_d_ff > 0``) makes it Qwen2-MoE,
none Mixtral. Both route as ``softmax`` then ``top_k`` (Mixtral normalises the chosen gates,
Qwen2-MoE when ``norm_topk_prob``). What we do not model is refused by name: sliding-window
attention, Qwen2-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step`` other than 1),
Mixtral's router jitter.
"""

from __future__ import annotations

from meshdsl.models.families.llama_configs import LlamaConfig

__all__ = ["MOE_TYPES", "model_type", "moe_fields", "moe_config_dict", "expert_key"]

MOE_TYPES = ("mixtral", "qwen2_moe")
_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}

# our path inside ``layers.ffn`` -> the HF name inside ``model.layers.i.`` ({e}: the expert)
_NAMES = {
    "mixtral": {
        ("router", "kernel"): "block_sparse_moe.gate.weight",
        ("experts", "wi_0", "kernel"): "block_sparse_moe.experts.{e}.w1.weight",
        ("experts", "wi_1", "kernel"): "block_sparse_moe.experts.{e}.w3.weight",
        ("experts", "wo", "kernel"): "block_sparse_moe.experts.{e}.w2.weight",
    },
    "qwen2_moe": {
        ("router", "kernel"): "mlp.gate.weight",
        ("experts", "wi_0", "kernel"): "mlp.experts.{e}.gate_proj.weight",
        ("experts", "wi_1", "kernel"): "mlp.experts.{e}.up_proj.weight",
        ("experts", "wo", "kernel"): "mlp.experts.{e}.down_proj.weight",
        ("shared", "wi_0", "kernel"): "mlp.shared_expert.gate_proj.weight",
        ("shared", "wi_1", "kernel"): "mlp.shared_expert.up_proj.weight",
        ("shared", "wo", "kernel"): "mlp.shared_expert.down_proj.weight",
        ("shared_gate", "kernel"): "mlp.shared_expert_gate.weight",
    },
}


def model_type(config: LlamaConfig) -> str:
    """HF's ``model_type`` of our ``config``: ``llama`` (dense), ``qwen2_moe`` (experts and a shared
    expert) or ``mixtral`` (experts only)."""
    if not config.is_moe:
        return "llama"
    return "qwen2_moe" if config.shared_d_ff else "mixtral"


def expert_key(config: LlamaConfig, names: tuple[str, ...]) -> str:
    """The HF name (inside ``model.layers.i.``, ``{e}`` for the expert) of our parameter ``names``
    inside ``layers.ffn``."""
    table = _NAMES[model_type(config)]
    if names not in table:
        raise ValueError(f"{config.name}: {'/'.join(names)} has no {_ARCHITECTURES[model_type(config)]} name")
    return table[names]


def moe_fields(kind: str, g) -> dict:
    """Our :class:`LlamaConfig` fields of a Mixtral or Qwen2-MoE HF config (``g(key, default)``
    reads it); ValueError naming what we do not model."""
    problems = []
    if kind == "mixtral":
        if g("sliding_window") is not None:
            problems.append(f"sliding_window={g('sliding_window')} (full attention only: set it to None)")
        if g("router_jitter_noise", 0.0):
            problems.append(f"router_jitter_noise={g('router_jitter_noise')} (no router jitter: set it to 0)")
        fields = dict(experts=g("num_local_experts", 8), normalize_gates=True, qkv_bias=False)
    else:
        if g("use_sliding_window", False):
            problems.append("use_sliding_window=True (full attention only: set it to False)")
        if g("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step={g('decoder_sparse_step')} (every layer sparse: set it to 1)")
        if g("mlp_only_layers") or []:
            problems.append(f"mlp_only_layers={g('mlp_only_layers')} (every layer sparse: set it to [])")
        if not g("shared_expert_intermediate_size", 5632):
            problems.append("shared_expert_intermediate_size=0 (Qwen2-MoE has a shared expert)")
        fields = dict(experts=g("num_experts", 60), normalize_gates=bool(g("norm_topk_prob", False)),
                      qkv_bias=bool(g("qkv_bias", True)), moe_d_ff=g("moe_intermediate_size", 1408),
                      shared_d_ff=g("shared_expert_intermediate_size", 5632))
    if problems:
        raise ValueError(f"unsupported {_ARCHITECTURES[kind]} config: {', '.join(problems)}")
    return {**fields, "top_k": g("num_experts_per_tok", 2 if kind == "mixtral" else 4),
            "load_balancing_coef": float(g("router_aux_loss_coef", 0.001))}


def moe_config_dict(config: LlamaConfig) -> dict:
    """The MoE keys of ``config.json`` for our MoE ``config`` (``architectures`` and ``model_type``
    included); ValueError where HF's class cannot express it."""
    kind = model_type(config)
    common = {"architectures": [_ARCHITECTURES[kind]], "model_type": kind, "num_experts_per_tok": config.top_k,
              "router_aux_loss_coef": config.load_balancing_coef, "output_router_logits": False}
    if kind == "qwen2_moe":
        return {**common, "num_experts": config.experts, "moe_intermediate_size": config.expert_d_ff,
                "shared_expert_intermediate_size": config.shared_d_ff, "norm_topk_prob": config.normalize_gates,
                "qkv_bias": config.qkv_bias, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "use_sliding_window": False}
    problems = [f"{key}={getattr(config, key)} (set {key}={want}, or shared_d_ff > 0 for a Qwen2-MoE)"
                for key, want in (("qkv_bias", False), ("normalize_gates", True)) if getattr(config, key) != want]
    if config.expert_d_ff != config.d_ff:
        problems.append(f"moe_d_ff={config.moe_d_ff} != d_ff={config.d_ff} (Mixtral's experts are d_ff wide: "
                        "set moe_d_ff=None)")
    if problems:
        raise ValueError(f"{config.name}: Hugging Face's MixtralForCausalLM cannot express {'; '.join(problems)}")
    return {**common, "num_local_experts": config.experts, "sliding_window": None, "router_jitter_noise": 0.0}
