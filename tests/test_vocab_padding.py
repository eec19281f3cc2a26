"""A vocabulary that does not divide the mesh: the configs' ``vocab_multiple`` pads the tables
(Megatron's ``--make-vocab-size-divisible-by``) and the models mask the padding's logits.

Hugging Face Llama and T5 of vocabulary 97 load with 128-row tables and run with ``vocab`` split
over 4 devices: HF's logits on the true entries, the loss of HF's logits, HF's greedy tokens;
export and ``save_pretrained`` give HF its 97 rows back. Padding rows made to win when unmasked
are never chosen (argmax, top-k, top-p, samples, beams) and change no loss; the layout error for
an unpadded vocabulary names the option. Models are built offline from small random configs.
"""

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
import meshdsl.models  # noqa: E402
from meshdsl.models import hf  # noqa: E402
from meshdsl.models.configs import config_from_dict, get_config  # noqa: E402
from meshdsl.models.families.family import describe  # noqa: E402
from meshdsl.models.loss import cross_entropy  # noqa: E402
from meshdsl.models.training.runrecord import differences  # noqa: E402

VOCAB, PADDED = 97, 128
MESH = md.Mesh({"model": 4}, devices=jax.devices()[:4])
SPLIT = md.Layout({"vocab": "model"})
NEW = 4
_MODELS = {}


def hf_model(kind):
    """A random-weight HF model of vocabulary 97, built once per kind."""
    if kind not in _MODELS:
        torch.manual_seed(0)
        if kind == "llama":
            hm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, rope_theta=1000.0, rms_norm_eps=1e-6))
        else:
            hm = transformers.T5ForConditionalGeneration(transformers.T5Config(
                vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False))
        _MODELS[kind] = hm.eval()
    return _MODELS[kind]


def tokens(shape, seed, low=0):
    return np.random.RandomState(seed).randint(low, VOCAB, shape)


def named(ids):
    return md.named(jnp.asarray(ids, jnp.int32), "batch length")


def hf_logits(hm, ids, dec=None):
    with torch.no_grad():
        if dec is None:
            return hm(torch.tensor(ids)).logits.numpy()
        return hm(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(dec)).logits.numpy()


def forward(model, *ids):
    return model(*ids)


def our_logits(model, ids, dec=None, *, split=True):
    """Float32 numpy logits ``[batch, length, 128]``, with ``vocab`` split over 4 devices."""
    args = (named(ids),) if dec is None else (named(ids), named(dec))
    f = md.lower(forward, MESH, SPLIT) if split else nnx.jit(forward)
    return np.asarray(f(model, *args).array)


def numpy_loss(logits, targets):
    """Mean cross-entropy and mean squared log-partition (T5X's z-loss) of HF's logits."""
    peak = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - peak).sum(-1)) + peak[..., 0]
    target = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return (lse - target).mean(), (lse ** 2).mean()


def split_loss(logits, targets):
    """``(loss, z_loss)`` of our logits by ``cross_entropy`` with ``vocab`` split over 4 devices."""
    def f(x, t):
        _, metrics = cross_entropy(x, t)
        return metrics["loss"], metrics["z_loss"]
    x = md.named(jnp.asarray(logits), "batch targets vocab")
    loss, z = md.lower(f, MESH, SPLIT)(x, md.named(jnp.asarray(targets, jnp.int32), "batch targets"))
    return float(np.asarray(loss.array)), float(np.asarray(z.array))


def hf_greedy(hm, ids, **kw):
    with torch.no_grad():
        return hm.generate(input_ids=torch.tensor(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           eos_token_id=1, **kw).numpy()


def check_padded_tables(model, table_paths):
    assert model.config.vocab == VOCAB and model.config.padded_vocab == PADDED
    for path in table_paths:
        table = path(model).get_value()
        assert table.dims["vocab"].size == PADDED
        rows = np.moveaxis(np.asarray(table.array), table.names.index("vocab"), 0)
        assert np.all(rows[VOCAB:] == 0), "the padding rows are zeros"


# -- Hugging Face models of vocabulary 97, vocab split over 4 devices ---------------------------------


def equal_to_hugging_face(got, expected, targets, model, hm, prompt, **generate):
    """Our logits on the true entries, the padding masked, the loss, and greedy tokens under
    ``vocab:model`` equal Hugging Face's."""
    np.testing.assert_allclose(got[..., :VOCAB], expected, atol=1e-4 * np.abs(expected).max())
    assert np.all(got[..., VOCAB:] == np.finfo(np.float32).min), "padding masked"
    np.testing.assert_allclose(split_loss(got, targets), numpy_loss(expected, targets), rtol=1e-5)
    greedy = meshdsl.models.generate(model, prompt, max_new_tokens=NEW, mesh=MESH, layout=SPLIT)
    np.testing.assert_array_equal(np.asarray(greedy.array), hf_greedy(hm, prompt, **generate))


def test_hf_llama_of_an_odd_vocabulary_runs_split_over_vocab_like_hugging_face():
    hm = hf_model("llama")
    model = hf.load(hm)
    check_padded_tables(model, [lambda m: m.embed.embedding, lambda m: m.lm_head.kernel])
    ids = tokens((2, 9), 1)
    expected = hf_logits(hm, ids)
    got = our_logits(model, ids)
    assert got.shape == (2, 9, PADDED)
    equal_to_hugging_face(got, expected, tokens((2, 9), 2), model, hm, tokens((2, 5), 3, low=2))


def test_hf_t5_of_an_odd_vocabulary_runs_split_over_vocab_like_hugging_face():
    hm = hf_model("t5")
    model = hf.load(hm)
    check_padded_tables(model, [lambda m: m.shared.embedding, lambda m: m.lm_head.kernel])
    enc, dec = tokens((2, 8), 4), tokens((2, 6), 5)
    expected = hf_logits(hm, enc, dec)
    got = our_logits(model, enc, dec)
    equal_to_hugging_face(got, expected, tokens((2, 6), 6), model, hm, tokens((2, 7), 7, low=2),
                          decoder_start_token_id=0)


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_export_and_save_pretrained_give_hugging_face_its_true_vocabulary(kind, tmp_path):
    hm = hf_model(kind)
    model = hf.load(hm)
    exported = hf.export(model)
    reference = hm.state_dict()
    assert set(exported) == set(reference)
    for key, value in reference.items():
        np.testing.assert_array_equal(exported[key], value.numpy(), err_msg=key)   # 97 rows, HF's values
    fresh = type(hm)(hm.config).eval()
    fresh.load_state_dict({k: torch.tensor(v) for k, v in exported.items()})
    ids, dec = tokens((2, 6), 8), (None if kind == "llama" else tokens((2, 5), 9))
    np.testing.assert_array_equal(hf_logits(fresh, ids, dec), hf_logits(hm, ids, dec))

    directory = hf.save_pretrained(model, tmp_path / kind)
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["vocab_size"] == VOCAB
    theirs = type(hm).from_pretrained(directory).eval()
    expected = our_logits(model, ids, dec, split=False)
    np.testing.assert_allclose(hf_logits(theirs, ids, dec), expected[..., :VOCAB], atol=1e-5 * np.abs(expected).max())
    back = hf.load_pretrained(directory)
    assert back.config.vocab == VOCAB and back.config.padded_vocab == PADDED
    np.testing.assert_array_equal(our_logits(back, ids, dec, split=False), expected)


# -- the padding never wins ---------------------------------------------------------------------------


def with_winning_padding(model):
    """``model`` with large padding columns in its output table, in pairs ``w, -w``: unmasked, one
    of each pair has a logit ``|w . y|`` far above any true token's (HF's init: std 0.02), so the
    padding would win every argmax, every top-k and nearly all the softmax's mass."""
    kernel = model.lm_head.kernel.get_value()                            # [d_model, vocab]
    values = np.asarray(kernel.array).copy()
    w = np.random.RandomState(0).normal(size=(values.shape[0], (PADDED - VOCAB) // 2)) * 20
    values[:, VOCAB:VOCAB + 2 * w.shape[1]] = np.concatenate([w, -w], 1)
    model.lm_head.kernel.set_value(md.param(md.named(jnp.asarray(values), kernel.dims)))
    return model


def unmasked_argmax(model, *args):
    """The argmax of ``model``'s logits were its padding a true part of the vocabulary."""
    twin = nnx.merge(*nnx.split(model))
    twin.config = model.config.replace(vocab=PADDED)
    return np.asarray(nnx.jit(forward)(twin, *map(named, args)).array).argmax(-1)


def test_padding_that_would_win_is_never_chosen_and_adds_no_loss():
    hm = hf_model("llama")
    model, plain = with_winning_padding(hf.load(hm)), hf.load(hm)
    ids, targets = tokens((2, 9), 10), tokens((2, 9), 11)
    assert np.all(unmasked_argmax(model, ids) >= VOCAB), "the padding would win"
    got = our_logits(model, ids)
    np.testing.assert_array_equal(got, our_logits(plain, ids))
    assert split_loss(got, targets) == split_loss(our_logits(plain, ids), targets)
    prompt = tokens((2, 5), 12, low=2)
    runs = {"greedy": {}, "sample": dict(key=jax.random.key(1)),      # cold: the padding's logits become -inf
            "cold top-k top-p": dict(key=jax.random.key(2), temperature=0.5, top_k=VOCAB, top_p=0.9)}
    for name, kw in runs.items():
        method = "greedy" if name == "greedy" else "sample"
        out = meshdsl.models.generate(model, prompt, max_new_tokens=NEW, method=method, mesh=MESH, layout=SPLIT, **kw)
        assert np.asarray(out.array).max() < VOCAB, name
    t5, prompt = with_winning_padding(hf.load(hf_model("t5"))), tokens((2, 7), 13, low=2)
    assert np.all(unmasked_argmax(t5, prompt, prompt[:, :3]) >= VOCAB), "the padding would win"
    beams = meshdsl.models.generate(t5, prompt, max_new_tokens=NEW, method="beam", num_beams=2, mesh=MESH,
                                    layout=SPLIT)
    assert np.asarray(beams.array).max() < VOCAB


def test_padding_rows_get_no_gradient():
    model = hf.load(hf_model("llama"))
    ids, targets = named(tokens((2, 9), 14)), md.named(jnp.asarray(tokens((2, 9), 15), jnp.int32), "batch targets")
    def loss(m):
        return cross_entropy(md.rename(m(ids), {"length": "targets"}), targets, z_loss=1e-2)[0].array

    grads = nnx.jit(nnx.grad(loss))(model)
    for table in (grads.embed.embedding, grads.lm_head.kernel):
        table = table.get_value() if hasattr(table, "get_value") else table
        rows = np.moveaxis(np.asarray(table.array), table.names.index("vocab"), 0)
        assert np.all(rows[VOCAB:] == 0) and np.any(rows[:VOCAB] != 0)


# -- configs, errors, Hugging Face config.json ---------------------------------------------------------


def test_vocab_multiple_pads_the_true_vocabulary_and_one_means_none():
    for name in ("t5-tiny", "t5-small", "t5-v1_1-base", "llama-tiny", "llama-2-7b", "llama-3-8b"):
        c = get_config(name)
        assert c.vocab_multiple == 128 and c.padded_vocab == c.vocab, name   # the published shapes stay
    c = get_config("llama-tiny", vocab=VOCAB)
    assert c.padded_vocab == PADDED and c.replace(vocab_multiple=1).padded_vocab == VOCAB
    assert c.replace(vocab_multiple=64).padded_vocab == 128 and c.replace(vocab=50257).padded_vocab == 50304
    assert config_from_dict(json.loads(json.dumps(c.replace(vocab_multiple=64).__dict__))).vocab_multiple == 64
    t5 = get_config("t5-tiny", vocab=VOCAB, vocab_multiple=32)
    assert t5.padded_vocab == 128 and config_from_dict(dict(t5.__dict__)) == t5
    assert "vocab 97 (padded to 128)" in describe(c)
    with pytest.raises(ValueError, match="vocab_multiple must be a positive int"):
        c.replace(vocab_multiple=0)


def test_an_unpadded_vocabulary_split_unevenly_names_vocab_multiple():
    from meshdsl.models.llama import Llama
    config = get_config("llama-tiny", d_model=32, d_ff=64, heads=4, kv_heads=2, layers=1, vocab=VOCAB,
                        vocab_multiple=1)
    model = Llama(config, rngs=nnx.Rngs(0))
    with pytest.raises(md.LayoutError, match=r"dim 'vocab' of size 97 is split over model\(4\) = 4 devices, which "
                       r"does not divide 97; .*'vocab' is padded by the model config's vocab_multiple: e\.g\. "
                       r"--override vocab_multiple=128"):
        md.lower(forward, MESH, SPLIT)(model, named(tokens((2, 4), 16)))


def test_hf_config_dict_of_a_llama_config_is_a_llama_config_json():
    out = hf.hf_config_dict(get_config("llama-tiny", vocab=VOCAB))
    assert out["model_type"] == "llama" and out["architectures"] == ["LlamaForCausalLM"]
    assert out["vocab_size"] == VOCAB and out["num_key_value_heads"] == 2
    assert hf.hf_config_dict(get_config("t5-tiny"))["model_type"] == "t5"


def test_a_run_recorded_before_vocab_multiple_resumes_at_its_default():
    """A run.json written before the config had ``vocab_multiple`` trained with the default
    padding: resuming it is no change of model; another multiple is one."""
    current = dict(get_config("llama-tiny").__dict__)
    older = {k: v for k, v in current.items() if k != "vocab_multiple"}
    assert differences({"config": older}, {"config": current}) == []
    assert differences({"config": older}, {"config": {**current, "vocab_multiple": 64}}) == \
        ["model vocab_multiple: 128 -> 64"]
