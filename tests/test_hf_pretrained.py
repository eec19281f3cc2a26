"""Hugging Face directories: ``save_pretrained`` writes what ``transformers``' ``from_pretrained``
loads with the same logits (T5 v1.1, v1.0, Switch from random configs), and ``load_pretrained``
reads it back without torch. Offline: nothing is downloaded."""

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import meshdsl as md  # noqa: E402
from meshdsl.models import hf  # noqa: E402

SMALL = dict(vocab_size=96, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2)


def hf_configs():
    transformers = pytest.importorskip("transformers")
    return {
        "t5-v1.1": (transformers.T5ForConditionalGeneration,
                    transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **SMALL)),
        "t5-v1.0": (transformers.T5ForConditionalGeneration,
                    transformers.T5Config(feed_forward_proj="relu", tie_word_embeddings=True, **SMALL)),
        "switch": (transformers.SwitchTransformersForConditionalGeneration,
                   transformers.SwitchTransformersConfig(num_experts=4, expert_capacity=3, encoder_sparse_step=2,
                                                         decoder_sparse_step=2, **SMALL)),
    }


def random_model(config, seed=0):
    from flax import nnx

    from meshdsl.models.t5 import T5
    return T5(config, rngs=nnx.Rngs(params=seed))


def tokens(shape, seed):
    return np.random.RandomState(seed).randint(0, SMALL["vocab_size"], shape)


def logits(model, enc, dec):
    """The logits of the true vocabulary (the model's tables are padded to 128 rows)."""
    out = model(md.named(enc, "batch length"), md.named(dec, "batch length"))
    return np.asarray(out.array)[..., :SMALL["vocab_size"]]


@pytest.mark.parametrize("name", ["t5-v1.1", "t5-v1.0", "switch"])
def test_save_pretrained_loads_in_transformers_with_the_same_logits(name, tmp_path):
    torch = pytest.importorskip("torch")
    cls, hf_config = hf_configs()[name]
    ours = random_model(hf.config_from_hf(hf_config), seed=3)
    directory = hf.save_pretrained(ours, tmp_path / name)
    assert sorted(os.listdir(directory)) == ["config.json", "model.safetensors"]
    theirs = cls.from_pretrained(directory).eval()
    enc, dec = tokens((2, 12), 1), tokens((2, 8), 2)
    with torch.no_grad():
        expected = theirs(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits.numpy()
    got = logits(ours, enc, dec)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    back = hf.load_pretrained(directory)  # numpy + safetensors only
    np.testing.assert_allclose(logits(back, enc, dec), got, rtol=1e-6, atol=1e-6)
    assert back.config.replace(name="") == ours.config.replace(name="")


def test_load_pretrained_reads_a_directory_transformers_wrote(tmp_path):
    torch = pytest.importorskip("torch")
    cls, hf_config = hf_configs()["t5-v1.0"]
    torch.manual_seed(0)
    theirs = cls(hf_config).eval()
    theirs.save_pretrained(tmp_path / "theirs")  # safetensors, tied embeddings written once
    ours = hf.load_pretrained(tmp_path / "theirs")
    enc, dec = tokens((2, 10), 4), tokens((2, 6), 5)
    with torch.no_grad():
        expected = theirs(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits.numpy()
    assert np.abs(logits(ours, enc, dec) - expected).max() <= 1e-4 * np.abs(expected).max()


def test_configs_hugging_face_cannot_express_are_refused(tmp_path):
    from meshdsl.models.configs import get_config
    moe = get_config("moe-t5-tiny").replace(vocab=96)
    with pytest.raises(ValueError, match="expert_capacity"):
        hf.hf_config_dict(moe)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", **SMALL}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        hf.load_pretrained(tmp_path)
