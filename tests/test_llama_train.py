"""The training CLI trains the decoder-only Llama (``--model llama-tiny``, next-token prediction on
packed windows of the corpus): its loss falls; Megatron over the key/value heads gives the same
losses as data parallel, and so does context parallelism with ``--attention ring``; your own text
files train too; ``python -m meshdsl.models.generate`` continues a prompt from the run;
``python -m meshdsl.models.export`` writes a directory that ``transformers`` loads with the same
logits; ``--eval-only`` evaluates the run on its own data. A decoder-only model defaults to
``--task lm`` and AdamW with Llama's recipe, and its summary has no encoder; span corruption, and a
layout rule for a dim Llama lacks (T5's ``heads``), are one-line errors.

Runs go through ``main(argv)`` in this process (8 virtual CPU devices from conftest).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import meshdsl as md
from meshdsl.models.train import build_parser, main, parse_args

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
    from meshdsl.models.data import corpus
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


def test_eval_only_evaluates_the_run_on_its_own_data(run, capsys):
    result = main(["--eval-only", "--out", str(run["out"]), "--model", "llama-tiny"])
    assert result["records"][0]["step"] == STEPS and np.isfinite(result["records"][0]["val_loss"])
    assert "eval       checkpoint step 8: validation loss" in capsys.readouterr().out


# -- the options: per-family defaults, --attention, the summary ------------------------------------


def test_help_names_every_model_family_and_the_attention_strategies():
    text = " ".join(build_parser().format_help().split())
    assert "Train T5, MoE-T5 (Switch) or the decoder-only Llama" in text
    assert "--attention {auto,gather,ring,ulysses}" in text and "kv_heads:model" in text
    assert "b2 0.95, weight decay 0.1" in text


def test_llama_defaults_to_lm_and_adamw_with_llamas_recipe_and_t5_keeps_adafactor():
    from meshdsl.models.training.optim import ADAMW, default_warmup
    llama, t5 = parse_args(["--model", "llama-tiny"]), parse_args(["--model", "t5-tiny"])
    assert (llama.task, llama.optimizer, llama.attention) == ("lm", "adamw", "auto")
    assert (t5.task, t5.optimizer) == ("span_corruption", "adafactor")
    assert ADAMW["decoder-only"] == {"b1": 0.9, "b2": 0.95, "weight_decay": 0.1}
    assert default_warmup("adamw", 300, "decoder-only") == 15
    assert default_warmup("adamw", 10**6, "decoder-only") == 2000      # Llama 2's warmup, not 5 % of the run
    assert default_warmup("adafactor", 300, "encoder-decoder") == 10_000
    chosen = parse_args(["--model", "llama-tiny", "--optimizer", "adafactor", "--attention", "ring"])
    assert (chosen.optimizer, chosen.attention) == ("adafactor", "ring")


def test_an_optimizer_in_a_config_file_wins_over_the_family_default(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: llama-tiny\noptimizer: adafactor\n")
    assert parse_args(["--config", str(config)]).optimizer == "adafactor"


def test_an_unknown_attention_strategy_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "llama-tiny", "--attention", "rign"])
    assert e.value.code == 2
    assert "argument --attention: invalid choice: 'rign'" in capsys.readouterr().err


def test_the_summary_of_a_llama_run_is_decoder_only():
    from meshdsl.models.configs import get_config
    from meshdsl.models.training import runinfo
    args = parse_args(["--model", "llama-tiny", "--attention", "ring", "--batch", "8"])
    baseline = {"unigram_entropy": 5.7, "unigram_cross_entropy": 5.9, "target_unigram_entropy": 5.7}
    text = runinfo.summary(args, get_config("llama-tiny"), md.Mesh.parse("data:8"), md.Layout.parse("batch:data"),
                           1, 64, baseline)
    assert "encoder" not in text and "decoder" not in text
    assert "layers 2" in text and "d_model 64" in text and "heads 4 (2 kv)" in text and "vocab 8192" in text
    assert "M parameters" in text and "attention=ring" in text
    assert "lm (next-token prediction), batch 8 x 64 tokens, accum 1; optimizer adamw" in text


def test_attention_ring_trains_under_context_parallelism_with_the_data_parallel_losses(run, tmp_path):
    """--attention ring on data:2 x ctx:4 with the sequence split over ctx (the attention's own dims
    too): the keys and values rotate by collective-permute, and the losses are data parallel's."""
    result = main([*RUN, "--steps", "2", "--ckpt-every", "-1", "--eval-batches", "0", "--mesh", "data:2,ctx:4",
                   "--layout", "batch:data;length:ctx;seq:ctx;kv_seq:ctx", "--attention", "ring",
                   "--out", str(tmp_path / "ring")])
    np.testing.assert_allclose(losses(result), losses(run)[:2], rtol=1e-4)
    assert result["trainer"].grad_fn.attention == "ring"
    assert "collective-permute" in result["trainer"].compile(None, None).as_text()   # (compiled once: the run's)
    assert json.loads((tmp_path / "ring" / "run.json").read_text())["attention"] == "ring"


# -- layout rules that shard nothing ------------------------------------------------------------------


def test_a_layout_rule_for_a_dim_llama_lacks_names_its_dims_and_the_megatron_rule(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--mesh", "data:2,model:4", "--layout", "batch:data;heads:model;d_ff:model", "--steps", "1",
              "--out", str(tmp_path / "bad")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: --layout rule 'heads' matches no dim of llama-tiny (its dims: batch, d_ff, d_head, "
                          "d_model, groups, kv_heads, kv_seq, layers, length, seq, targets, vocab); for Megatron on "
                          "Llama use kv_heads:model")
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_params_layout_rule_for_a_dim_llama_lacks_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--params-layout", "d_modl:data", "--steps", "1", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --params-layout rule 'd_modl' matches no dim of llama-tiny (its dims: ")
    assert err.endswith("(did you mean 'd_model'?); fix the dim name")


def test_the_trainer_lowers_llama_with_every_rule_required_to_match(tmp_path):
    """Outside the CLI too: the Trainer's programs are lowered with unused_rules="error"."""
    import jax
    from meshdsl.models.configs import get_config
    from meshdsl.models.training.optim import make_optimizer
    from meshdsl.models.training.trainer import Trainer, named_batch
    tx, schedule = make_optimizer("adamw", family="decoder-only")
    trainer = Trainer(get_config("llama-tiny"), md.Mesh.parse("data:2,model:4"), md.Layout.parse("heads:model"),
                      tx, schedule)
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32)
    batch = named_batch({"decoder_input_tokens": tokens, "decoder_target_tokens": tokens})
    with pytest.raises(md.LayoutError, match=r"layout rule for 'heads' matches no dim of the program \(its dims: "
                                             r"batch, d_ff, d_head, d_model, groups, kv_heads"):
        trainer.eval_fn.trace(trainer.abstract_state()["params"], batch)

