"""Training batches from token ids: the second half of the data pipeline.

Data flow::

    token ids of each document            (meshdsl.models.data.corpus: KJV or your text files)
      -> one token stream per epoch       documents shuffled and concatenated (LM view: eos after each)
      -> chunks                           the stream cut into fixed-length pieces
      -> examples                         T5 span corruption, or decoder-only LM windows
      -> global batches                   each process takes its contiguous share of the rows

Packing is concatenate-and-split (T5's `reduce_concat_tokens` + `split_tokens`), not seqio's
`trim_and_pack`: chunks run across document boundaries, so every row is full and no segment ids
or positions are needed. Only the last chunk of the validation stream is shorter; it is padded, and
`decoder_loss_weights` is 0 on padding (and on the all-padding rows that fill up the last
validation batch). Training drops the remainder of each epoch's stream instead.

Every example is a pure function of (seed, split, global example index), and step `s` holds the
global examples `s*batch ... s*batch + batch - 1`. So resuming at `start_step=k` equals skipping `k`
batches, and the per-process batches of `process_count` processes, concatenated in process order,
equal the global batch of one process.

Span corruption ports T5 (`t5.data.preprocessors`): `random_spans_helper`, `random_spans_noise_mask`,
`noise_span_to_unique_sentinel`, `nonnoise_span_to_unique_sentinel`, with numpy Generators seeded
per example instead of TF stateless seeds.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

from meshdsl.models.data.corpus import SPLITS, Vocabulary, load_vocabulary, tokenized_documents

KINDS = ("span_corruption", "lm")
NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0
_NOISE, _SHUFFLE = 0, 1  # tags that keep the example-noise and epoch-shuffle random streams apart

Batch = dict[str, np.ndarray]


# ------------------------------------------------------------------------ span corruption

def random_spans_helper(inputs_length: int, noise_density: float = NOISE_DENSITY,
                        mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
                        extra_tokens_per_span_inputs: int = 1,
                        extra_tokens_per_span_targets: int = 1) -> tuple[int, int]:
    """(raw tokens to cut from the stream, targets length): the longest raw chunk whose corrupted
    inputs, with eos, fit in `inputs_length`. T5's values: 512 -> (568, 114)."""
    def corrupted_lengths(tokens_length: int) -> tuple[int, int]:
        num_noise = int(round(tokens_length * noise_density))
        num_spans = int(round(num_noise / mean_noise_span_length))
        return (tokens_length - num_noise + num_spans * extra_tokens_per_span_inputs + 1,
                num_noise + num_spans * extra_tokens_per_span_targets + 1)

    tokens_length = inputs_length - 1
    while corrupted_lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = corrupted_lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:  # T5's hack for round lengths
        tokens_length, targets_length = tokens_length - 1, targets_length - 1
    return tokens_length, targets_length


def random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of a uniformly random partition of `num_items` items into `num_segments` non-empty
    consecutive segments."""
    first_in_segment = np.concatenate([[0], rng.permutation(np.arange(num_items - 1) < num_segments - 1)])
    return np.bincount(np.cumsum(first_in_segment), minlength=num_segments)


def random_spans_noise_mask(length: int, rng: np.random.Generator, noise_density: float = NOISE_DENSITY,
                            mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> np.ndarray:
    """Boolean noise mask of `length` tokens: round(length * density) noise tokens in
    max(1, round(num_noise / mean_span)) spans, alternating non-noise / noise, starting with
    non-noise; all such masks equally likely. Rounding in float32, half to even, as T5 in TF."""
    if noise_density == 0.0:
        return np.zeros(length, bool)
    padded_length = max(length, 2)
    num_noise = int(np.round(np.float32(padded_length) * np.float32(noise_density)))
    num_noise = min(max(num_noise, 1), padded_length - 1)
    num_spans = max(int(np.round(np.float32(num_noise) / np.float32(mean_noise_span_length))), 1)
    noise_lengths = random_segmentation(num_noise, num_spans, rng)
    nonnoise_lengths = random_segmentation(padded_length - num_noise, num_spans, rng)
    span_lengths = np.stack([nonnoise_lengths, noise_lengths], axis=1).ravel()
    span_index = np.repeat(np.arange(2 * num_spans), span_lengths)
    return (span_index % 2 == 1)[:length]


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, first_sentinel: int) -> np.ndarray:
    """Each run of noise tokens replaced by one sentinel: `first_sentinel`, then counting down."""
    previous_is_noise = np.concatenate([[False], noise_mask[:-1]])
    first_noise = noise_mask & ~previous_is_noise
    sentinels = first_sentinel + 1 - np.cumsum(first_noise)
    return np.where(first_noise, sentinels, tokens)[~(noise_mask & previous_is_noise)].astype(np.int32)


def nonnoise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, first_sentinel: int) -> np.ndarray:
    """Each run of non-noise tokens replaced by one sentinel (the targets of span corruption)."""
    return noise_span_to_unique_sentinel(tokens, ~noise_mask, first_sentinel)


def _count_runs(mask: np.ndarray) -> int:
    """Number of maximal runs of True in a boolean vector."""
    return int((mask & ~np.concatenate([[False], mask[:-1]])).sum())


def span_corruption(tokens: np.ndarray, noise_mask: np.ndarray, vocab: Vocabulary) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of T5 span corruption for one token sequence and mask, eos appended to both."""
    runs = max(_count_runs(noise_mask), _count_runs(~noise_mask))
    if runs > vocab.num_sentinels:
        raise ValueError(f"{runs} spans need more than the {vocab.num_sentinels} sentinels")
    eos = np.array([vocab.eos_id], np.int32)
    first = vocab.sentinel(0)
    return (np.concatenate([noise_span_to_unique_sentinel(tokens, noise_mask, first), eos]),
            np.concatenate([nonnoise_span_to_unique_sentinel(tokens, noise_mask, first), eos]))


# --------------------------------------------------------------------------------- examples

def shift_right(targets: np.ndarray) -> np.ndarray:
    """Decoder inputs: the targets shifted right by one along the last axis, 0 as start token."""
    return np.concatenate([np.zeros_like(targets[..., :1]), targets[..., :-1]], axis=-1)


def _pad(tokens: np.ndarray, length: int) -> np.ndarray:
    if len(tokens) > length:
        raise ValueError(f"sequence of {len(tokens)} tokens does not fit in {length}")
    return np.pad(np.asarray(tokens, np.int32), (0, length - len(tokens)))


def _decoder_features(targets: np.ndarray, decoder_length: int) -> Batch:
    padded = _pad(targets, decoder_length)
    return {"decoder_input_tokens": shift_right(padded), "decoder_target_tokens": padded,
            "decoder_loss_weights": _pad(np.ones(len(targets), np.int32), decoder_length)}


def span_corruption_example(raw: np.ndarray, rng: np.random.Generator, vocab: Vocabulary, encoder_length: int,
                            decoder_length: int, noise_density: float = NOISE_DENSITY,
                            mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> Batch:
    """One encoder-decoder example (1-D int32 arrays) from a chunk of raw tokens."""
    mask = random_spans_noise_mask(len(raw), rng, noise_density, mean_noise_span_length)
    inputs, targets = span_corruption(raw, mask, vocab)
    return {"encoder_input_tokens": _pad(inputs, encoder_length), **_decoder_features(targets, decoder_length)}


def lm_example(raw: np.ndarray, decoder_length: int) -> Batch:
    """One decoder-only example: targets = the window, inputs = the window shifted right."""
    return _decoder_features(raw, decoder_length)


# ------------------------------------------------------------------------------ the stream

class TokenChunks:
    """Fixed-length chunks of the concatenated documents of one split, by global example index.

    With `shuffle_seed` (training): endless epochs; epoch e concatenates the documents in a
    permutation drawn from (seed, e), drops the remainder, and visits its chunks in another
    permutation. Without (validation): one pass in corpus order, the last chunk possibly shorter.
    """

    def __init__(self, documents: Sequence[np.ndarray], length: int, shuffle_seed: int | None = None):
        self.documents, self.length, self.seed = list(documents), length, shuffle_seed
        total = sum(len(d) for d in self.documents)
        self.chunks_per_epoch = total // length if shuffle_seed is not None else -(-total // length)
        if self.chunks_per_epoch == 0:
            raise ValueError(f"the corpus split has {total} tokens, fewer than one chunk of {length}")
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        """Chunks in one epoch (the whole split, for validation)."""
        return self.chunks_per_epoch

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(token stream, chunk order) of an epoch; the two most recent are kept."""
        if epoch not in self._epochs:
            if self.seed is None:
                doc_order, chunk_order = range(len(self.documents)), np.arange(self.chunks_per_epoch)
            else:
                rng = np.random.default_rng([self.seed, _SHUFFLE, epoch])
                doc_order, chunk_order = rng.permutation(len(self.documents)), rng.permutation(self.chunks_per_epoch)
            stream = np.concatenate([self.documents[i] for i in doc_order]).astype(np.int32)
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = (stream, chunk_order)
        return self._epochs[epoch]

    def __getitem__(self, index: int) -> np.ndarray:
        epoch, position = divmod(index, self.chunks_per_epoch)
        if self.seed is None and epoch > 0:
            raise IndexError(f"validation has {self.chunks_per_epoch} chunks, asked for {index}")
        stream, order = self._epoch(epoch)
        start = int(order[position]) * self.length
        return stream[start:start + self.length]


# ---------------------------------------------------------------------------- the batches

def make_dataset(kind: str = "span_corruption", split: str = "train", batch: int = 8, encoder_length: int = 512,
                 decoder_length: int | None = None, seed: int = 0, process_index: int = 0, process_count: int = 1,
                 start_step: int = 0, text_files: Sequence[str] | None = None, vocab: Vocabulary | None = None,
                 noise_density: float = NOISE_DENSITY,
                 mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> Iterator[Batch]:
    """Iterator of this process's share of each global batch: dicts of int32 numpy arrays.

    kind="span_corruption": `encoder_input_tokens` (rows, encoder_length) and `decoder_input_tokens`,
    `decoder_target_tokens`, `decoder_loss_weights` (rows, decoder_length); decoder_length defaults
    to T5's targets length for encoder_length (114 for 512).
    kind="lm": the three decoder features over windows of decoder_length tokens (default
    encoder_length) of the stream with eos after each document; encoder_length is otherwise unused.

    `batch` is the global batch; each of `process_count` processes gets `batch // process_count`
    rows, process `process_index` the `process_index`-th block. split="train" is endless and
    reshuffled every epoch from `seed` (an int >= 0); split="validation" is one pass in corpus
    order (`seed` only draws the noise masks). `start_step=k` starts at the k-th batch. `vocab` defaults to
    `load_vocabulary(text_files)`.
    """
    if kind not in KINDS or split not in SPLITS:
        raise ValueError(f"kind must be one of {KINDS} and split one of {SPLITS}, got {kind!r}, {split!r}")
    if batch % process_count or not 0 <= process_index < process_count:
        raise ValueError(f"batch {batch} must split evenly over process {process_index} of {process_count}")
    vocab = vocab or load_vocabulary(text_files)
    documents = tokenized_documents(vocab, split, text_files)
    if kind == "lm":
        chunks, example, empty = _lm_examples(documents, vocab, decoder_length or encoder_length,
                                              seed if split == "train" else None)
    else:
        chunks, example, empty = _span_corruption_examples(documents, vocab, split, seed, encoder_length,
                                                           decoder_length, noise_density, mean_noise_span_length)
    num_examples = len(chunks) if split == "validation" else None
    return _batches(example, empty, num_examples, batch, start_step, process_index, process_count)


def _lm_examples(documents: Sequence[np.ndarray], vocab: Vocabulary, decoder_length: int,
                 shuffle_seed: int | None) -> tuple[TokenChunks, Callable[[int], Batch], Batch]:
    """(chunks, example by global index, all-padding example) of the decoder-only LM view."""
    eos = np.array([vocab.eos_id], np.int32)
    chunks = TokenChunks([np.concatenate([d, eos]) for d in documents], decoder_length, shuffle_seed)
    return chunks, lambda index: lm_example(chunks[index], decoder_length), lm_example(eos[:0], decoder_length)


def _span_corruption_examples(documents: Sequence[np.ndarray], vocab: Vocabulary, split: str, seed: int,
                              encoder_length: int, decoder_length: int | None, noise_density: float,
                              mean_noise_span_length: float) -> tuple[TokenChunks, Callable[[int], Batch], Batch]:
    """(chunks, example by global index, all-padding example) of T5 span corruption."""
    raw_length, targets_length = random_spans_helper(encoder_length, noise_density, mean_noise_span_length)
    decoder_length = decoder_length or targets_length
    if decoder_length < targets_length:
        raise ValueError(f"decoder_length {decoder_length} is shorter than the {targets_length} targets "
                         f"of encoder_length {encoder_length}")
    chunks = TokenChunks(documents, raw_length, seed if split == "train" else None)

    def example(index: int) -> Batch:
        rng = np.random.default_rng([seed, _NOISE, SPLITS.index(split), index])
        return span_corruption_example(chunks[index], rng, vocab, encoder_length, decoder_length,
                                       noise_density, mean_noise_span_length)

    empty = {"encoder_input_tokens": np.zeros(encoder_length, np.int32),
             **_decoder_features(np.zeros(0, np.int32), decoder_length)}
    return chunks, example, empty


def _batches(example: Callable[[int], Batch], empty: Batch, num_examples: int | None, batch: int, start_step: int,
             process_index: int, process_count: int) -> Iterator[Batch]:
    """This process's rows of global batches from `start_step` on; endless when `num_examples` is
    None, else until the examples run out, the last batch filled with `empty` rows."""
    rows = batch // process_count
    step = start_step
    while num_examples is None or step * batch < num_examples:
        first = step * batch + process_index * rows
        examples = [example(i) if num_examples is None or i < num_examples else empty
                    for i in range(first, first + rows)]
        yield {key: np.stack([e[key] for e in examples]) for key in empty}
        step += 1
