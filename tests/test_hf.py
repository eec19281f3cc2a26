"""Hugging Face parity: weights imported from transformers give the same logits (T5 v1.1, v1.0,
Switch), unsharded and under a sharded layout; export gives back HF's state dict.

Models are built from random small configs offline (no download).
"""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import meshdsl as md  # noqa: E402
from meshdsl.models import hf  # noqa: E402
from meshdsl.models.configs import CONFIGS  # noqa: E402
from meshdsl.models.t5 import count_params  # noqa: E402

SMALL = dict(vocab_size=96, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2)


def hf_models():
    torch.manual_seed(0)
    yield "t5-v1.1", transformers.T5ForConditionalGeneration(
        transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **SMALL))
    yield "t5-v1.0", transformers.T5ForConditionalGeneration(
        transformers.T5Config(feed_forward_proj="relu", tie_word_embeddings=True, **SMALL))
    yield "switch", transformers.SwitchTransformersForConditionalGeneration(
        transformers.SwitchTransformersConfig(num_experts=4, expert_capacity=3, encoder_sparse_step=2,
                                              decoder_sparse_step=2, **SMALL))


MODELS = dict(hf_models())


def tokens(vocab, shape, seed):
    return np.random.RandomState(seed).randint(0, vocab, shape)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_hugging_face(name):
    hm = MODELS[name].eval()
    model = hf.load(hm)
    enc, dec = tokens(SMALL["vocab_size"], (4, 12), 1), tokens(SMALL["vocab_size"], (4, 8), 2)
    with torch.no_grad():
        expected = hm(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits.numpy()
    e, d = md.named(enc, "batch length"), md.named(dec, "batch length")
    got = np.asarray(model(e, d).array)[..., :SMALL["vocab_size"]]     # the true vocabulary (128 padded)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 1e-4 * scale
    layouts = {"Megatron": md.Layout({"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}),
               "expert parallel + ZeRO-3": md.Layout({"batch": "data", "group": "data", "experts": "data"},
                                                     params={"d_model": "model"})}
    for layout in layouts.values():
        f = md.lower(lambda m, e, d: m(e, d), md.Mesh({"data": 2, "model": 4}), layout)
        sharded = np.asarray(f(model, e, d).array)[..., :SMALL["vocab_size"]]
        assert np.abs(sharded - expected).max() <= 1e-4 * scale


@pytest.mark.parametrize("name", list(MODELS))
def test_export_gives_back_the_state_dict(name):
    hm = MODELS[name]
    exported = hf.export(hf.load(hm))
    reference = hm.state_dict()
    assert set(exported) == set(reference)
    for key, value in reference.items():
        np.testing.assert_array_equal(exported[key], value.numpy())
    fresh = type(hm)(hm.config)
    fresh.load_state_dict({k: torch.tensor(v) for k, v in exported.items()})


def test_switch_drops_tokens_like_hugging_face():
    """With capacity 3 for 12 tokens and 4 experts some tokens are dropped; HF keeps gate * input."""
    hm = MODELS["switch"].eval()
    model = hf.load(hm)
    enc = tokens(SMALL["vocab_size"], (2, 12), 3)
    _, (enc_metrics, _) = model.forward(md.named(enc, "batch length"), md.named(enc[:, :4], "batch length"))
    dropped = [float(m["dropped_fraction"].array.max()) for m in enc_metrics if m]
    assert max(dropped) > 0


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if not c.name.endswith("tiny")])
def test_parameter_counts_equal_hugging_face(name):
    """Every published size, counted by HF on the meta device (no memory), and by us abstractly."""
    c = CONFIGS[name]
    common = dict(vocab_size=c.vocab, d_model=c.d_model, d_ff=c.d_ff, d_kv=c.d_kv, num_heads=c.heads,
                  num_layers=c.encoder_layers, num_decoder_layers=c.decoder_layers,
                  tie_word_embeddings=c.tie_embeddings)
    with torch.device("meta"):
        if c.is_moe:
            hm = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
                num_experts=c.num_experts, expert_capacity=c.expert_capacity, encoder_sparse_step=c.moe_every,
                decoder_sparse_step=c.moe_every, **common))
        else:
            hm = transformers.T5ForConditionalGeneration(transformers.T5Config(
                feed_forward_proj=c.activation, **common))
    assert count_params(c) == sum(p.numel() for p in hm.parameters())
