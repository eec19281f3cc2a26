"""The training CLI trains the decoder-only Llama (``--model llama-tiny``, next-token prediction on
packed windows of the corpus): its loss falls; Megatron over the key/value heads gives the same
losses as data parallel; your own text files train too; ``python -m meshdsl.models.generate``
continues a prompt from the run; ``python -m meshdsl.models.export`` writes a directory that
``transformers`` loads with the same logits; span corruption is refused for a decoder-only model.

Runs go through ``main(argv)`` in this process (8 virtual CPU devices from conftest).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import meshdsl as md
from meshdsl.models.train import main

RUN = ["--model", "llama-tiny", "--batch", "8", "--decoder-length", "32", "--log-every", "1", "--no-explain",
       "--eval-batches", "2", "--eval-every", "0", "--optimizer", "adamw", "--lr", "3e-3", "--warmup", "1"]
MEGATRON = ["--mesh", "data:4,model:2", "--layout", "batch:data;kv_heads:model;d_ff:model;vocab:model"]
STEPS = 8


def losses(result) -> list[float]:
    return [r["loss"] for r in result["records"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """8 data-parallel steps of llama-tiny, checkpointed at the end."""
    out = tmp_path_factory.mktemp("llama") / "dp"
    return main([*RUN, "--steps", str(STEPS), "--ckpt-every", "0", "--out", str(out)])


def test_llama_trains_and_its_loss_falls(run):
    got = losses(run)
    assert len(got) == STEPS and abs(got[0] - np.log(8192)) < 0.5 and got[-1] < got[0] - 0.5
    assert run["records"][-1]["val_loss"] < got[0] - 0.5
    with open(f"{run['out']}/run.json") as f:
        recorded = json.load(f)
    assert recorded["task"] == "lm" and recorded["config"]["kv_heads"] == 2
    assert type(run["trainer"].model(run["state"]["params"])).__name__ == "Llama"


def test_megatron_gives_the_data_parallel_losses(run, tmp_path):
    result = main([*RUN, *MEGATRON, "--steps", str(STEPS), "--ckpt-every", "-1", "--eval-batches", "0",
                   "--out", str(tmp_path / "megatron")])
    np.testing.assert_allclose(losses(result), losses(run), rtol=1e-4)
    kernel = result["state"]["params"]["layers"]["attention"]["q"]["kernel"].get_value()
    assert kernel.names == ("layers", "d_model", "kv_heads", "groups", "d_head")
    assert kernel.array.sharding.spec[2] == "model"


def test_own_text_files(tmp_path):
    from meshdsl.models import corpus
    verses = [line for doc in corpus.load_documents("train") for line in doc.split("\n")][:300]
    text = tmp_path / "own.txt"
    text.write_text("\n".join(verses) + "\n", encoding="utf-8")
    result = main([*RUN, "--steps", "2", "--ckpt-every", "-1", "--eval-batches", "0", "--text-files", str(text),
                   "--out", str(tmp_path / "own")])
    assert len(losses(result)) == 2 and np.isfinite(losses(result)).all()
    assert result["trainer"].config.vocab < 8192      # the vocabulary of the file, not of the KJV


def test_generate_cli_continues_a_prompt_from_the_run(run, capsys):
    from meshdsl.models.generate import main as generate_main
    prompts = ["And God said", "In the beginning God created the heaven"]
    texts = generate_main(["--run", str(run["out"]), "--max-new-tokens", "6", *sum((["--prompt", p] for p in prompts),
                                                                                    [])])
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert "And God said\n  -> " in capsys.readouterr().out
    sharded = generate_main(["--run", str(run["out"]), "--max-new-tokens", "6", "--mesh", "data:2,model:4",
                             "--layout", "batch:data;kv_length:model", *sum((["--prompt", p] for p in prompts), [])])
    assert sharded == texts


def test_export_loads_in_transformers_with_the_same_logits(run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from meshdsl.models.export import export_run
    out, step = export_run(str(run["out"]), str(tmp_path / "hf"))
    assert step == STEPS
    hm = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = np.random.RandomState(0).randint(0, 8192, (2, 12))
    ours = run["trainer"].model(run["state"]["params"])
    expected = np.asarray(ours(md.named(ids, "batch length")).array)
    with torch.no_grad():
        got = hm(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4 * np.abs(expected).max())


def test_span_corruption_is_refused_for_a_decoder_only_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--task", "span_corruption", "--steps", "1", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2
    assert "decoder-only: it trains with --task lm" in capsys.readouterr().err
