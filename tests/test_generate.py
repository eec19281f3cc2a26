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
from meshdsl.models.decoding.sampling import filter_logits  # noqa: E402
from meshdsl.models.generation import Generator  # noqa: E402

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


LAYOUTS = {
    "batch-split": md.Layout({"batch": "data"}),
    "1d-weight-stationary": md.Layout({"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}),
    "2d-weight-stationary": md.Layout({"d_model": "data", "heads": "model", "d_ff": "model", "vocab": "model",
                                       "kv_length": "data"}),
    "weight-gathered": md.Layout({"batch": "data"}, params={"d_model": "model"}),
    "kv-split": md.Layout({"batch": "data", "kv_length": "model"}),
}
PER_METHOD = {   # >= 4 layouts each, every layout used; greedy and sampling share prefill programs
    "greedy": ["batch-split", "2d-weight-stationary", "weight-gathered", "kv-split"],
    "sample": ["batch-split", "2d-weight-stationary", "weight-gathered", "kv-split"],   # greedy's prefills
    "beam": ["1d-weight-stationary", "weight-gathered", "kv-split", "batch-split"],
}


# sampling under every layout: -m slow (~30 s); by default its filters are checked against Hugging
# Face (test_filters_equal_hugging_face_warpers) and the layout invariance of md.random by the fuzzer
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "sample" else m
                                    for m in PER_METHOD])
def test_same_tokens_under_every_layout(method):
    _, model = models("t5-v1.1")
    ids = prompts(seed=2)
    kw = dict(max_new_tokens=NEW, method=method)   # the HF test's shapes: its compiled programs are reused
    if method == "sample":
        kw.update(key=jax.random.key(3), temperature=0.9, top_k=20, top_p=0.9)
    if method == "beam":
        kw.update(num_beams=4)
    expected = np.asarray(meshdsl.models.generate(model, ids, **kw).array)
    for name in PER_METHOD[method]:
        layout = LAYOUTS[name]
        if name == "2d-weight-stationary":   # a layout per phase: prefill batch-split, decode 2-D
            layout = {"prefill": LAYOUTS["batch-split"], "decode": layout}
        got = meshdsl.models.generate(model, ids, mesh=MESH, layout=layout, **kw)
        np.testing.assert_array_equal(np.asarray(got.array), expected, err_msg=f"{method} under {name}")


def test_decode_step_compiles_once():
    _, model = models("t5-v1.0")
    prefill_layout = md.Layout({"batch": "data", "d_ff": "model"})        # a prefill program of its own
    g = Generator(MESH, prefill_layout, LAYOUTS["1d-weight-stationary"])
    ids = prompts(seed=4)[:, :6] + 2
    meshdsl.models.generate(model, ids, max_new_tokens=5, eos_id=-1, generator=g)
    first = dict(g.traces)   # each program traced once, or twice where its plan beats the rules' choices
    meshdsl.models.generate(model, ids, max_new_tokens=5, eos_id=-1, generator=g)   # 5 more positions
    assert g.traces == first and set(first.values()) <= {1, 2}
    assert len(g.step._programs) == 1


def test_filters_equal_hugging_face_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    logits = np.random.RandomState(0).normal(size=(3, 40)).astype(np.float32) * 3
    named = md.named(jnp.asarray(logits), "batch vocab")
    for temperature, top_k, top_p in [(1.0, 5, None), (0.7, None, 0.8), (1.3, 12, 0.5), (1.0, None, 0.99)]:
        expected = torch.tensor(logits)
        expected = TemperatureLogitsWarper(temperature)(None, expected)
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p:
            expected = TopPLogitsWarper(top_p)(None, expected)
        ours = filter_logits(named, "vocab", temperature=temperature, top_k=top_k, top_p=top_p)
        np.testing.assert_allclose(np.asarray(ours.array), expected.numpy(), rtol=1e-6)
        sharded = md.lower(lambda x: filter_logits(x, "vocab", temperature=temperature, top_k=top_k, top_p=top_p),
                           MESH, md.Layout({"vocab": "model"}))(named)
        np.testing.assert_array_equal(np.isinf(np.asarray(sharded.array)), np.isinf(expected.numpy()))


@pytest.mark.parametrize("kw, message", [
    (dict(method="topk"), "method must be one of"),
    (dict(method="beam", num_beams=0), "num_beams must be an int"),
    (dict(method="beam", num_beams=40), "num_beams must be an int"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
    (dict(method="sample"), "needs key="),
    (dict(method="sample", key=jax.random.key(0), top_p=1.5), "top_p must be in"),
    (dict(method="sample", key=jax.random.key(0), top_k=0), "top_k must be an int"),
    (dict(method="sample", key=jax.random.key(0), temperature=0.0), "temperature must be > 0"),
    (dict(top_k=5), "are for method='sample'"),
    (dict(layout=md.Layout({"batch": "data"})), "a layout needs a mesh="),
    (dict(mesh=MESH, layout={"prefil": md.Layout({})}), "keys 'prefill' and 'decode'"),
])
def test_errors_are_clear(kw, message):
    _, model = models("t5-v1.1")
    args = {"max_new_tokens": 4, **kw}
    with pytest.raises(md.MeshDSLError, match=message):
        meshdsl.models.generate(model, prompts(), **args)
