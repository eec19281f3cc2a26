"""The data pipeline: corpus split, cached vocabulary, T5 span corruption, batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshdsl.models.data import batches as data, corpus
from meshdsl.models.data.batches import (
    TokenChunks, make_dataset, nonnoise_span_to_unique_sentinel, noise_span_to_unique_sentinel,
    random_segmentation, random_spans_helper, random_spans_noise_mask, span_corruption, shift_right,
)
from meshdsl.models.data.corpus import Vocabulary

SPAN_KEYS = {"encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh vocabulary cache directory for this module."""
    directory = tmp_path_factory.mktemp("meshdsl_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHDSL_CACHE", str(directory))
        yield directory


@pytest.fixture(scope="module")
def vocab(cache) -> Vocabulary:
    """The KJV vocabulary, trained once into the module's cache."""
    return corpus.load_vocabulary()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A small user corpus: 400 KJV verses, one paragraph per line, blank lines in between."""
    verses = [line for doc in corpus.load_documents("train") for line in doc.split("\n")][:400]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n\n".join(verses) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def small_vocab(cache, text_file) -> Vocabulary:
    return corpus.load_vocabulary([text_file], vocab_size=500)


class FakeVocab:
    """Just what span corruption needs: 100 sentinels below id 200."""
    eos_id, num_sentinels, unpadded_size = 1, 100, 200

    def sentinel(self, i):
        return self.unpadded_size - 1 - i


def reconstruct(inputs: np.ndarray, targets: np.ndarray, vocab) -> np.ndarray:
    """The original tokens: each sentinel in the inputs replaced by what follows it in the targets."""
    sentinels = set(range(vocab.unpadded_size - vocab.num_sentinels, vocab.unpadded_size))
    fills, current = {}, None
    for t in targets[:-1]:
        if int(t) in sentinels:
            current = int(t)
            fills[current] = []
        else:
            fills[current].append(int(t))
    out = []
    for t in inputs[:-1]:
        out.extend(fills[int(t)] if int(t) in sentinels else [int(t)])
    return np.array(out)


# ------------------------------------------------------------------------ span corruption

def test_random_spans_helper_gives_t5_lengths():
    assert random_spans_helper(512) == (568, 114)
    assert random_spans_helper(128) == (141, 29)


@pytest.mark.parametrize("inputs_length", [16, 64, 100, 512, 1024])
def test_random_spans_helper_fills_inputs_exactly_with_no_padding(inputs_length):
    tokens, targets = random_spans_helper(inputs_length)
    mask = random_spans_noise_mask(tokens, np.random.default_rng(0))
    inputs, outputs = span_corruption(np.arange(tokens) + 2, mask, FakeVocab())
    assert len(inputs) == inputs_length and len(outputs) == targets


def test_span_corruption_hand_checked_length_20():
    tokens = np.arange(10, 30)                       # t0..t19 are ids 10..29
    mask = np.zeros(20, bool)
    mask[[3, 4, 5, 10, 15, 16]] = True               # noise spans t3-t5, t10, t15-t16
    s0, s1, s2, s3 = 199, 198, 197, 196              # <extra_id_0..3> of FakeVocab
    assert noise_span_to_unique_sentinel(tokens, mask, s0).tolist() == [
        10, 11, 12, s0, 16, 17, 18, 19, s1, 21, 22, 23, 24, s2, 27, 28, 29]
    assert nonnoise_span_to_unique_sentinel(tokens, mask, s0).tolist() == [
        s0, 13, 14, 15, s1, 20, s2, 25, 26, s3]
    inputs, targets = span_corruption(tokens, mask, FakeVocab())
    assert inputs[-1] == 1 and targets[-1] == 1      # eos appended to both
    assert targets.tolist() == [s0, 13, 14, 15, s1, 20, s2, 25, 26, s3, 1]


def test_noise_mask_of_length_20_has_3_noise_tokens_in_1_span_after_non_noise():
    for seed in range(20):
        mask = random_spans_noise_mask(20, np.random.default_rng(seed))
        assert mask.sum() == 3 and not mask[0]
        assert np.flatnonzero(mask).tolist() == list(range(np.argmax(mask), np.argmax(mask) + 3))


@given(length=st.integers(1, 600), seed=st.integers(0, 2**31))
def test_noise_mask_counts_and_alternation(length, seed):
    mask = random_spans_noise_mask(length, np.random.default_rng(seed))
    n = max(length, 2)
    num_noise = min(max(int(np.round(np.float32(n) * np.float32(0.15))), 1), n - 1)
    num_spans = max(int(np.round(np.float32(num_noise) / np.float32(3.0))), 1)
    assert mask.shape == (length,) and mask.dtype == bool
    if length >= 2:
        assert mask.sum() == num_noise and not mask[0]
        assert data._count_runs(mask) == num_spans
        assert data._count_runs(~mask) in (num_spans, num_spans + 1)
    np.testing.assert_array_equal(mask, random_spans_noise_mask(length, np.random.default_rng(seed)))


@given(num_items=st.integers(1, 200), fraction=st.floats(0, 1), seed=st.integers(0, 1000))
def test_random_segmentation_is_a_partition_into_non_empty_segments(num_items, fraction, seed):
    num_segments = 1 + int(fraction * (num_items - 1))
    lengths = random_segmentation(num_items, num_segments, np.random.default_rng(seed))
    assert len(lengths) == num_segments and lengths.sum() == num_items and lengths.min() >= 1


@given(length=st.integers(2, 400), seed=st.integers(0, 2**31))
def test_span_corruption_keeps_every_token_once_with_sentinels_in_order(length, seed):
    vocab = FakeVocab()
    tokens = np.random.default_rng(seed).integers(2, 100, length)
    mask = random_spans_noise_mask(length, np.random.default_rng(seed))
    inputs, targets = span_corruption(tokens, mask, vocab)
    is_sentinel_in, is_sentinel_out = inputs >= 100, targets >= 100
    np.testing.assert_array_equal(inputs[~is_sentinel_in][:-1], tokens[~mask])   # non-noise, in order
    np.testing.assert_array_equal(targets[~is_sentinel_out][:-1], tokens[mask])  # noise, in order
    spans = data._count_runs(mask)
    assert inputs[is_sentinel_in].tolist() == [vocab.sentinel(i) for i in range(spans)]
    assert targets[is_sentinel_out].tolist() == [vocab.sentinel(i) for i in range(data._count_runs(~mask))]
    assert len(inputs) == length - mask.sum() + spans + 1
    np.testing.assert_array_equal(reconstruct(inputs, targets, vocab), tokens)


def test_span_corruption_refuses_more_spans_than_sentinels():
    mask = np.arange(404) % 2 == 1                   # 202 one-token spans
    with pytest.raises(ValueError, match="sentinels"):
        span_corruption(np.arange(404), mask, FakeVocab())


def test_shift_right_starts_with_zero():
    assert shift_right(np.array([[5, 6, 7]])).tolist() == [[0, 5, 6]]


# -------------------------------------------------------------------- corpus, vocabulary

def test_kjv_split_is_deterministic_disjoint_and_about_5_percent():
    train, validation = corpus.load_documents("train"), corpus.load_documents("validation")
    assert len(train) + len(validation) == 1189                   # chapters of the Bible
    assert not set(train) & set(validation)
    assert 0.03 < len(validation) / 1189 < 0.07
    assert train[0].startswith("In the beginning God created the heaven and the earth.")
    assert all(corpus.is_validation(d) for d in validation) and not any(map(corpus.is_validation, train))
    assert "[" not in "".join(train)


def test_vocabulary_has_t5_layout(vocab):
    assert (vocab.sp_size, vocab.unpadded_size, vocab.size) == (8000, 8100, 8192)
    assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
    assert vocab.sentinel(0) == 8099 and vocab.sentinel(99) == 8000
    assert vocab.processor.id_to_piece(0) == "<pad>" and vocab.processor.id_to_piece(1) == "</s>"
    with pytest.raises(ValueError):
        vocab.sentinel(100)


def test_vocabulary_round_trips_text(vocab):
    text = "And God said, Let there be light: and there was light."
    ids = vocab.encode(text)
    assert 0 not in ids and 1 not in ids and max(ids) < vocab.sp_size
    assert vocab.decode(ids) == text
    assert vocab.decode(ids + [vocab.eos_id] + ids) == text       # stops at eos
    assert vocab.decode([0] + ids + [0]) == text                  # drops padding
    assert vocab.decode(vocab.encode("light") + [vocab.sentinel(3)]) == "light <extra_id_3>"
    assert [a.tolist() for a in vocab.encode_documents([text, "a\nb"])] == [ids, vocab.encode("a\nb")]


def test_vocabulary_is_cached_on_disk_and_not_retrained(vocab, cache, monkeypatch):
    files = list((cache / "vocab").glob("unigram-8000-*.model"))
    assert len(files) == 1 and Vocabulary.from_file(files[0]) == vocab
    corpus._cached_vocabulary.cache_clear()
    monkeypatch.setattr(corpus, "train_sentencepiece", lambda *a, **k: pytest.fail("retrained"))
    assert corpus.load_vocabulary() == vocab


def test_text_files_are_one_document_per_non_blank_line(text_file, small_vocab):
    train = corpus.load_documents("train", [text_file])
    validation = corpus.load_documents("validation", [text_file])
    assert len(train) + len(validation) == 400 and not set(train) & set(validation)
    assert all("\n" not in d for d in train)
    assert small_vocab.sp_size <= 500 and small_vocab.size % 128 == 0
    assert small_vocab.sentinel(0) == small_vocab.sp_size + 99


def test_unigram_entropy_and_cross_entropy():
    assert corpus.unigram_entropy(np.array([3, 4, 5, 6] * 5)) == pytest.approx(np.log(4))
    assert corpus.unigram_entropy(np.array([7, 7, 7])) == 0.0
    # add-one smoothing over 4 ids: counts [1+1, 1+1, 1+3, 1+0] / 9
    assert corpus.unigram_cross_entropy(np.array([0, 1, 2, 2, 2]), np.array([2, 3]), 4) == pytest.approx(
        -(np.log(4 / 9) + np.log(1 / 9)) / 2)


# --------------------------------------------------------------------------------- batches

def test_span_corruption_batches_have_t5_shapes_and_features(vocab):
    batch = next(make_dataset(batch=4, encoder_length=128, decoder_length=32, vocab=vocab))
    assert set(batch) == SPAN_KEYS
    assert all(v.dtype == np.int32 for v in batch.values())
    assert batch["encoder_input_tokens"].shape == (4, 128) and batch["decoder_target_tokens"].shape == (4, 32)
    np.testing.assert_array_equal(batch["decoder_input_tokens"], shift_right(batch["decoder_target_tokens"]))
    np.testing.assert_array_equal(batch["decoder_loss_weights"], batch["decoder_target_tokens"] > 0)
    assert (batch["decoder_loss_weights"].sum(1) == 29).all()     # 141 raw tokens -> 29 targets, 3 padding
    assert (batch["encoder_input_tokens"][:, -1] == vocab.eos_id).all()
    assert batch["decoder_target_tokens"][0, 0] == vocab.sentinel(0)


def test_lm_batches_are_shifted_windows_with_eos_between_documents(vocab):
    batch = next(make_dataset("lm", batch=2, decoder_length=64, vocab=vocab))
    assert set(batch) == SPAN_KEYS - {"encoder_input_tokens"}
    np.testing.assert_array_equal(batch["decoder_input_tokens"], shift_right(batch["decoder_target_tokens"]))
    assert batch["decoder_loss_weights"].all()


@pytest.mark.parametrize("kind", ["span_corruption", "lm"])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_process_shares_concatenate_to_the_global_batch(vocab, kind, split):
    def batches(index, count):
        it = make_dataset(kind, split, batch=8, encoder_length=64, decoder_length=32, seed=3,
                          process_index=index, process_count=count, vocab=vocab)
        return [b for b, _ in zip(it, range(3))]

    single = batches(0, 1)
    for count in (2, 4):
        shares = [batches(i, count) for i in range(count)]
        for step, whole in enumerate(single):
            for key in whole:
                assert shares[0][step][key].shape[0] == 8 // count
                np.testing.assert_array_equal(np.concatenate([s[step][key] for s in shares]), whole[key])


@pytest.mark.parametrize("kind", ["span_corruption", "lm"])
def test_resuming_at_a_step_equals_skipping_batches(vocab, kind):
    fresh = make_dataset(kind, batch=4, encoder_length=64, decoder_length=32, seed=1, vocab=vocab)
    expected = [b for b, _ in zip(fresh, range(7))][5:]
    resumed = make_dataset(kind, batch=4, encoder_length=64, decoder_length=32, seed=1, start_step=5, vocab=vocab)
    for want, got in zip(expected, resumed):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_seed_changes_the_training_batches_only_through_the_seed(vocab):
    def first(seed):
        return next(make_dataset(batch=2, encoder_length=64, seed=seed, vocab=vocab))["encoder_input_tokens"]

    np.testing.assert_array_equal(first(0), first(0))
    assert not np.array_equal(first(0), first(1))


def test_validation_span_corruption_covers_the_split_once(vocab):
    batches = list(make_dataset(split="validation", batch=64, encoder_length=512, vocab=vocab))
    restored = [reconstruct(i[: np.flatnonzero(i == vocab.eos_id)[-1] + 1], t[w > 0], vocab)
                for b in batches
                for i, t, w in zip(b["encoder_input_tokens"], b["decoder_target_tokens"], b["decoder_loss_weights"])
                if w.any()]
    np.testing.assert_array_equal(np.concatenate(restored), corpus.corpus_tokens(vocab, "validation"))
    assert not batches[-1]["decoder_loss_weights"][-1].any()      # the last batch ends in empty rows


def test_validation_lm_covers_the_split_once_and_ends(small_vocab, text_file):
    batches = list(make_dataset("lm", "validation", batch=4, decoder_length=16, text_files=[text_file],
                                vocab=small_vocab))
    tokens = np.concatenate([b["decoder_target_tokens"][b["decoder_loss_weights"] > 0] for b in batches])
    documents = corpus.tokenized_documents(small_vocab, "validation", [text_file])
    np.testing.assert_array_equal(tokens, np.concatenate([np.append(d, small_vocab.eos_id) for d in documents]))


def test_training_epochs_cover_the_stream_in_a_new_order():
    documents = [np.arange(10 * i, 10 * i + 10) for i in range(6)]
    chunks = TokenChunks(documents, length=7, shuffle_seed=0)
    assert len(chunks) == 60 // 7
    for epoch in range(2):
        stream, order = chunks._epoch(epoch)
        got = [chunks[epoch * len(chunks) + k] for k in range(len(chunks))]
        np.testing.assert_array_equal(np.concatenate([got[k] for k in np.argsort(order)]), stream[:56])
        assert sorted(stream.tolist()) == list(range(60))
    assert not np.array_equal(chunks._epoch(0)[0], chunks._epoch(1)[0])


def test_text_file_corpus_feeds_training(small_vocab, text_file):
    batch = next(make_dataset(batch=2, encoder_length=64, text_files=[text_file], vocab=small_vocab))
    assert batch["encoder_input_tokens"].max() < small_vocab.size


def test_bad_arguments_are_refused(vocab):
    with pytest.raises(ValueError, match="decoder_length"):
        make_dataset(encoder_length=512, decoder_length=100, vocab=vocab)
    with pytest.raises(ValueError, match="split evenly"):
        make_dataset(batch=6, process_count=4, vocab=vocab)
    with pytest.raises(ValueError, match="kind"):
        make_dataset("mlm", vocab=vocab)
