"""Decoding (meshdsl.models.generate): greedy and beam tokens equal Hugging Face's ``generate``
for random-weight T5 v1.1, v1.0 and Switch models; greedy, sampled and beam tokens are the same
under every layout; the decode step is compiled once; filters match HF's warpers; errors.

Models are built offline from small random configs (no download).
"""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import meshdsl as md  # noqa: E402
import meshdsl.models  # noqa: E402
from meshdsl.models import hf  # noqa: E402
from meshdsl.models.generation import Generator  # noqa: E402
from meshdsl.models.sampling import filter_logits  # noqa: E402

SMALL = dict(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2)
MESH = md.Mesh({"data": 2, "model": 4})
NEW = 8


def hf_model(name):
    torch.manual_seed(0)
    if name == "t5-v1.1":
        m = transformers.T5ForConditionalGeneration(
            transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **SMALL))
    elif name == "t5-v1.0":
        m = transformers.T5ForConditionalGeneration(
            transformers.T5Config(feed_forward_proj="relu", tie_word_embeddings=True, **SMALL))
    else:
        m = transformers.SwitchTransformersForConditionalGeneration(
            transformers.SwitchTransformersConfig(num_experts=4, expert_capacity=3, encoder_sparse_step=2,
                                                  decoder_sparse_step=2, **SMALL))
    return m.eval()


_CACHE = {}


def models(name):
    if name not in _CACHE:
        hm = hf_model(name)
        _CACHE[name] = (hm, hf.load(hm))
    return _CACHE[name]


def prompts(seed=1, batch=4, length=10):
    ids = np.random.RandomState(seed).randint(2, SMALL["vocab_size"], (batch, length))
    ids[1, 7:] = 0                      # padding: HF masks it, so must we
    ids[2, 5] = 1                       # an eos inside the prompt is just a token
    return ids


def hf_generate(hm, ids, **kw):
    with torch.no_grad():
        out = hm.generate(input_ids=torch.tensor(ids), max_new_tokens=NEW, do_sample=False, decoder_start_token_id=0,
                          pad_token_id=0, eos_token_id=1, **kw)
    return out.numpy()


@pytest.mark.parametrize("name", ["t5-v1.1", "t5-v1.0", "switch"])
def test_greedy_and_beam_equal_hugging_face(name):
    hm, model = models(name)
    ids = prompts()
    for num_beams in (1, 4):
        expected = hf_generate(hm, ids, num_beams=num_beams)
        method = "greedy" if num_beams == 1 else "beam"
        got = meshdsl.models.generate(model, ids, max_new_tokens=NEW, method=method, num_beams=num_beams)
        np.testing.assert_array_equal(np.asarray(got.array), expected, err_msg=f"{name} num_beams={num_beams}")
        assert got.names == ("batch", "length")
