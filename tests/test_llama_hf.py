"""Llama against Hugging Face ``LlamaForCausalLM``: RMSNorm and rotary embeddings number for number;
imported weights give HF's logits (tied and untied embeddings, grouped-query and multi-head
attention), unsharded and under Megatron; greedy decoding gives HF's ``generate`` tokens (also
with left-padded prompts); ``save_pretrained`` writes a directory ``transformers`` loads with the
same logits and ``load_pretrained`` reads back; published configs count HF's parameters.

Models are built offline from small random configs (no download).
"""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import meshdsl as md  # noqa: E402
import meshdsl.models  # noqa: E402
from meshdsl.layers import RMSNorm, apply_rotary, rotary_angles  # noqa: E402
from meshdsl.models import hf  # noqa: E402
from meshdsl.models.configs import LLAMA_CONFIGS  # noqa: E402
from meshdsl.models.llama import Llama, count_params  # noqa: E402

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
             rope_theta=1000.0, rms_norm_eps=1e-6)
CASES = {   # (kv heads, tied embeddings): grouped-query untied, multi-head tied, multi-query untied
    "gqa": (2, False),
    "mha-tied": (4, True),
    "mqa": (1, False),
}
MESH = md.Mesh({"data": 2, "model": 4})
_MODELS = {}


def models(name):
    """``(HF model, ours imported from it)``, built once per case."""
    if name not in _MODELS:
        kv, tied = CASES[name]
        torch.manual_seed(0)
        hm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_key_value_heads=kv, tie_word_embeddings=tied, **SMALL)).eval()
        _MODELS[name] = hm, hf.load(hm)
    return _MODELS[name]


def tokens(shape, seed, low=0):
    return np.random.RandomState(seed).randint(low, VOCAB, shape)


def hf_logits(hm, ids, mask=None):
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return hm(torch.tensor(ids), **kw).logits.numpy()


def true_vocab(logits):
    """Our logits of the true vocabulary (the model's tables are padded to 128 rows)."""
    return np.asarray(logits.array)[..., :VOCAB]


def test_rms_norm_and_rotary_equal_hugging_face():
    from transformers.models.llama.modeling_llama import (
        LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb)
    x = np.random.RandomState(0).normal(size=(2, 5, 32)).astype(np.float32) * 3
    norm = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
        expected = norm(torch.tensor(x)).numpy()
    ours = RMSNorm(md.Dim("d_model", 32), eps=1e-5)
    ours.scale.set_value(md.param(md.named(jnp.linspace(0.5, 1.5, 32), "d_model")))
    got = ours(md.named(x, "batch length d_model"))
    np.testing.assert_allclose(np.asarray(got.array), expected, rtol=1e-6, atol=1e-6)

    q = np.random.RandomState(1).normal(size=(2, 4, 9, 16)).astype(np.float32)
    positions = np.array([np.arange(9), np.arange(9) + 5])                # per-row positions too
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0)
    cos, sin = LlamaRotaryEmbedding(config)(torch.tensor(q), torch.tensor(positions))
    expected, _ = apply_rotary_pos_emb(torch.tensor(q), torch.tensor(q), cos, sin)
    angles = rotary_angles(md.named(positions, "batch length"), md.Dim("d_head", 16), 500000.0)
    got = apply_rotary(md.named(q, "batch heads length d_head"), *angles)
    assert got.names == ("batch", "heads", "length", "d_head")
    np.testing.assert_allclose(np.asarray(got.array), expected.numpy(), atol=2e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_hugging_face(name):
    hm, model = models(name)
    ids = tokens((4, 12), 1)
    expected = hf_logits(hm, ids)
    got = model(md.named(ids, "batch length"))
    assert got.names == ("batch", "length", "vocab")
    np.testing.assert_allclose(true_vocab(got), expected, atol=1e-4 * np.abs(expected).max())
    if name == "gqa":     # Megatron over the 2 key/value heads (and the query groups), and ZeRO-3 storage
        for mesh, layout in ((md.Mesh({"data": 2, "model": 2, "group": 2}),
                              md.Layout({"batch": "data", "kv_heads": "model", "groups": "group", "d_ff": "model",
                                         "vocab": "model"})),
                             (MESH, md.Layout({"batch": "data"}, params={"d_model": "model"}))):
            sharded = md.lower(lambda m, i: m(i), mesh, layout)(model, md.named(ids, "batch length"))
            np.testing.assert_allclose(true_vocab(sharded), expected, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_state_dict(name):
    hm, model = models(name)
    exported = hf.export(model)
    reference = hm.state_dict()
    assert set(exported) == set(reference)
    for key, value in reference.items():
        np.testing.assert_array_equal(exported[key], value.numpy(), err_msg=key)


def hf_generate(hm, ids, mask=None, new=8):
    kw = {} if mask is None else {"attention_mask": torch.tensor(mask)}
    with torch.no_grad():
        return hm.generate(input_ids=torch.tensor(ids), max_new_tokens=new, do_sample=False, pad_token_id=0,
                           eos_token_id=1, **kw).numpy()


@pytest.mark.parametrize("name", ["gqa", "mha-tied"])
def test_greedy_tokens_equal_hugging_face(name):
    hm, model = models(name)
    ids = tokens((4, 7), 2, low=2)
    got = meshdsl.models.generate(model, ids, max_new_tokens=8)
    assert got.names == ("batch", "length")
    np.testing.assert_array_equal(np.asarray(got.array), hf_generate(hm, ids))
    mask = np.ones_like(ids)          # left-padded prompts: HF's positions and padding mask
    mask[1, :3] = 0
    mask[3, :1] = 0
    padded = np.where(mask == 1, ids, 0)
    got = meshdsl.models.generate(model, padded, max_new_tokens=8, attention_mask=mask)
    np.testing.assert_array_equal(np.asarray(got.array), hf_generate(hm, padded, mask))


def test_save_pretrained_reloads_in_transformers_and_here(tmp_path):
    for name in ("gqa", "mha-tied"):
        hm, model = models(name)
        directory = hf.save_pretrained(model, tmp_path / name)
        reloaded = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
        ids = tokens((2, 10), 3)
        expected = true_vocab(model(md.named(ids, "batch length")))
        np.testing.assert_allclose(hf_logits(reloaded, ids), expected, atol=1e-5 * np.abs(expected).max())
        ours = hf.load_pretrained(directory)
        assert isinstance(ours, Llama) and ours.config.tie_embeddings == CASES[name][1]
        np.testing.assert_array_equal(true_vocab(ours(md.named(ids, "batch length"))), expected)
    # and HF's own directory, written by transformers
    hm, model = models("gqa")
    hm.save_pretrained(tmp_path / "hf-written")
    ours = hf.load_pretrained(tmp_path / "hf-written")
    ids = tokens((2, 6), 4)
    np.testing.assert_allclose(np.asarray(ours(md.named(ids, "batch length")).array),
                               np.asarray(model(md.named(ids, "batch length")).array), atol=1e-6)


def test_unsupported_configs_are_refused_by_name():
    from meshdsl.models.hub.hf_llama import config_from_hf
    with pytest.raises(ValueError, match="attention_bias=True"):
        config_from_hf(transformers.LlamaConfig(attention_bias=True, **SMALL))
    with pytest.raises(ValueError, match="rope_scaling"):
        config_from_hf({**SMALL, "model_type": "llama", "num_attention_heads": 4,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("name", [n for n in LLAMA_CONFIGS if not n.endswith("tiny")])
def test_parameter_counts_equal_hugging_face(name):
    """Every published shape, counted by HF on the meta device (no memory), and by us abstractly."""
    c = LLAMA_CONFIGS[name]
    config = transformers.LlamaConfig(
        vocab_size=c.vocab, hidden_size=c.d_model, intermediate_size=c.d_ff, num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads, num_hidden_layers=c.layers, tie_word_embeddings=c.tie_embeddings)
    with torch.device("meta"):
        hm = transformers.LlamaForCausalLM(config)
    assert count_params(c) == hm.num_parameters()
