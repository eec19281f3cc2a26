"""Mixtral and Qwen2-MoE against Hugging Face ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM``:
imported weights give HF's logits (a vocabulary of 97: padded tables), also under expert
parallelism; export gives back HF's state dict; ``save_pretrained`` writes a directory
``transformers`` loads with the same logits and ``load_pretrained`` reads back; greedy decoding
gives HF's ``generate`` tokens; the published configs count HF's parameters; what we do not model
is refused by name.

Models are built offline from small random configs (no download).
"""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import meshdsl as md  # noqa: E402
import meshdsl.models  # noqa: E402
from meshdsl.models import hf  # noqa: E402
from meshdsl.models.configs import MOE_DECODER_CONFIGS  # noqa: E402
from meshdsl.models.hub.hf_llama import config_from_hf  # noqa: E402
from meshdsl.models.llama import Llama, count_params  # noqa: E402

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, rope_theta=1000.0, rms_norm_eps=1e-6)
CASES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **SMALL)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=48,
        **SMALL)),
    "qwen2_moe-normalized": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=48,
        norm_topk_prob=True, tie_word_embeddings=True, **SMALL)),
}
_MODELS = {}


def models(name):
    """``(HF model, ours imported from it)``, built once per case; HF's zero biases made random."""
    if name not in _MODELS:
        torch.manual_seed(0)
        hm = CASES[name]().eval()
        with torch.no_grad():
            for key, p in hm.named_parameters():
                if key.endswith("bias"):
                    p.normal_()
        _MODELS[name] = hm, hf.load(hm)
    return _MODELS[name]


def tokens(shape, seed, low=0):
    return np.random.RandomState(seed).randint(low, VOCAB, shape)


def hf_logits(hm, ids):
    with torch.no_grad():
        return hm(torch.tensor(ids)).logits.numpy()


def true_vocab(logits):
    return np.asarray(logits.array)[..., :VOCAB]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_hugging_face(name):
    hm, model = models(name)
    assert model.config.is_moe and model.config.padded_vocab == 128
    assert model.config.qkv_bias == name.startswith("qwen")
    ids = tokens((4, 12), 1)
    expected = hf_logits(hm, ids)
    got = model(md.named(ids, "batch length"))
    assert got.names == ("batch", "length", "vocab")
    np.testing.assert_allclose(true_vocab(got), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    if name == "qwen2_moe":     # expert parallelism and Megatron inside the experts
        layout = md.Layout({"batch": "data", "experts": "data", "d_ff": "model", "d_shared": "model"})
        sharded = md.lower(lambda m, i: m(i), md.Mesh({"data": 4, "model": 2}), layout)(
            model, md.named(ids, "batch length"))
        np.testing.assert_allclose(true_vocab(sharded), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_state_dict(name):
    hm, model = models(name)
    exported = hf.export(model)
    reference = hm.state_dict()
    assert set(exported) == set(reference)
    for key, value in reference.items():
        np.testing.assert_array_equal(exported[key], value.numpy(), err_msg=key)


def test_save_pretrained_reloads_in_transformers_and_here(tmp_path):
    for name, cls in (("mixtral", transformers.MixtralForCausalLM), ("qwen2_moe", transformers.Qwen2MoeForCausalLM)):
        hm, model = models(name)
        directory = hf.save_pretrained(model, tmp_path / name)
        reloaded = cls.from_pretrained(directory).eval()
        assert reloaded.config.model_type == name
        ids = tokens((2, 10), 3)
        expected = true_vocab(model(md.named(ids, "batch length")))
        np.testing.assert_allclose(hf_logits(reloaded, ids), expected, atol=1e-5 * np.abs(expected).max())
        ours = hf.load_pretrained(directory)
        assert isinstance(ours, Llama) and ours.config.name == name and ours.config.experts == model.config.experts
        np.testing.assert_array_equal(true_vocab(ours(md.named(ids, "batch length"))), expected)


def test_greedy_tokens_equal_hugging_face():
    hm, model = models("qwen2_moe")
    ids = tokens((3, 6), 2, low=2)
    got = meshdsl.models.generate(model, ids, max_new_tokens=6)
    with torch.no_grad():
        expected = hm.generate(input_ids=torch.tensor(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
                               eos_token_id=1).numpy()
    np.testing.assert_array_equal(np.asarray(got.array), expected)


def _hf_config(c):
    common = dict(vocab_size=c.vocab, hidden_size=c.d_model, intermediate_size=c.d_ff, num_attention_heads=c.heads,
                  num_key_value_heads=c.kv_heads, num_hidden_layers=c.layers, tie_word_embeddings=c.tie_embeddings,
                  num_experts_per_tok=c.top_k)
    if c.shared_d_ff:
        return transformers.Qwen2MoeConfig(num_experts=c.experts, moe_intermediate_size=c.expert_d_ff,
                                           shared_expert_intermediate_size=c.shared_d_ff, **common)
    return transformers.MixtralConfig(num_local_experts=c.experts, **common)


@pytest.mark.parametrize("name", list(MOE_DECODER_CONFIGS))
def test_parameter_counts_equal_hugging_face(name):
    """Counted by HF on the meta device (no memory), and by us abstractly; our config round-trips."""
    c = MOE_DECODER_CONFIGS[name]
    config = _hf_config(c)
    with torch.device("meta"):
        hm = transformers.AutoModelForCausalLM.from_config(config)
    assert count_params(c) == hm.num_parameters()
    back = config_from_hf(hf.hf_config_dict(c))
    assert back.replace(name=c.name, d_head=None) == c


@pytest.mark.parametrize("values, message", [
    (dict(model_type="mixtral", sliding_window=64), "sliding_window=64"),
    (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    (dict(model_type="qwen2_moe", decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(model_type="qwen2_moe", mlp_only_layers=[0]), r"mlp_only_layers=\[0\]"),
    (dict(model_type="qwen2_moe", use_sliding_window=True), "use_sliding_window=True"),
])
def test_unsupported_hf_configs_are_refused_by_name(values, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**SMALL, **values})


def test_configs_hf_cannot_express_are_refused_by_name():
    mixtral = MOE_DECODER_CONFIGS["mixtral-tiny"]
    with pytest.raises(ValueError, match="qkv_bias=True"):
        hf.hf_config_dict(mixtral.replace(qkv_bias=True))
    with pytest.raises(ValueError, match="normalize_gates=False"):
        hf.hf_config_dict(mixtral.replace(normalize_gates=False))
    with pytest.raises(ValueError, match="moe_d_ff=32"):
        hf.hf_config_dict(mixtral.replace(moe_d_ff=32))
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot express qkv_bias=True"):
        hf.hf_config_dict(mixtral.replace(experts=0, qkv_bias=True))
