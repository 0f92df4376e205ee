"""The §5 recipe: schedule, optimizer settings, and a short real training run."""

import json

import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import MINI_MODEL, mini_run, read_log
from huggingface_hub import EvalResult, ModelCard
from safetensors.torch import load_file

from vaswani_transformer.checkpoints import average_checkpoints
from vaswani_transformer.hub import write_model_card
from vaswani_transformer.training import TrainingConfig, inverse_square_root_schedule


def test_learning_rate_schedule_is_equation_3():
    rate = inverse_square_root_schedule(d_model=512, warmup_steps=4000)
    for step in (1, 100, 3999, 4000, 4001, 100_000):
        expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert rate(step - 1) == pytest.approx(expected)
    peak = max(range(1, 10_000), key=lambda s: rate(s - 1))
    assert peak == 4000


def test_a_short_training_run_on_multi30k_lowers_the_validation_loss(trained_model_dir):
    log = [record for record in read_log(trained_model_dir) if "validation_loss" in record]
    assert [record["step"] for record in log] == [50, 100, 150]
    losses = [record["validation_loss"] for record in log]
    assert losses[-1] < losses[0] - 0.5, losses
    saved = json.loads((trained_model_dir / "training_config.json").read_text())
    assert saved["adam_beta2"] == 0.98 and saved["adam_epsilon"] == 1e-9
    # Each record says when it was written and how fast the steps before it went.
    minutes = [record["minutes"] for record in log]
    assert minutes == sorted(minutes) and minutes[0] > 0
    assert all(record["target_tokens_per_second"] > 0 for record in log)


def test_trained_directory_holds_model_tokenizer_generation_config_and_code(trained_model_dir):
    names = {path.name for path in trained_model_dir.iterdir()}
    expected = {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "modeling_vaswani.py",
        "configuration_vaswani.py",
        "pipeline_vaswani.py",
        "README.md",
        "learning_curve.png",
    }
    assert expected <= names
    # The last checkpoints stay, for `--resume` and `vaswani-transformer average`.
    assert sorted(p.name for p in (trained_model_dir / "checkpoints").iterdir()) == ["step-100", "step-150"]
    generation = json.loads((trained_model_dir / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["length_penalty"] == 0.6
    assert generation["length_penalty_type"] == "gnmt"
    assert (trained_model_dir / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_training_writes_a_model_card_with_hub_metadata_and_the_recipe(trained_model_dir):
    card = ModelCard.load(trained_model_dir / "README.md")
    data = card.data
    assert data.language == ["en", "de"] and data.pipeline_tag == "translation"
    assert data.library_name == "transformers" and data.license == "apache-2.0"
    assert data.datasets == ["multi30k"] and data.metrics == ["sacrebleu"]
    assert "## Intended use" in card.text and "## Limitations" in card.text
    assert "beam size 4, length penalty ((5 + |Y|) / 6)^0.6 (§6.1), at most input length + 50 tokens" in card.text
    log = read_log(trained_model_dir)
    assert f"{log[-1]['step']:,} steps" in card.text and "label smoothing 0.1" in card.text


def test_checkpoint_averaging_is_the_mean_of_the_weights(tmp_path):
    from safetensors.torch import save_file

    paths = []
    for i in range(3):
        path = tmp_path / f"step-{i}.safetensors"
        save_file({"w": torch.full((2, 2), float(i)), "b": torch.tensor([i * 3.0])}, path)
        paths.append(path)
    average = average_checkpoints(paths)
    torch.testing.assert_close(average["w"], torch.full((2, 2), 1.0))
    torch.testing.assert_close(average["b"], torch.tensor([3.0]))
    save_file({"other": torch.zeros(1)}, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="same tensors"):
        average_checkpoints([paths[0], tmp_path / "bad.safetensors"])
    # The same names with other shapes (another model size) would broadcast into a mean of nothing.
    save_file({"w": torch.zeros(2), "b": torch.zeros(1)}, tmp_path / "other-size.safetensors")
    with pytest.raises(ValueError, match="names and shapes"):
        average_checkpoints([paths[0], tmp_path / "other-size.safetensors"])
    assert load_file(paths[0])["w"].sum() == 0


def test_mixed_precision_auto_is_chosen_once_per_run_and_recorded(mini_corpus, tmp_path, monkeypatch):
    from vaswani_transformer import training

    with pytest.raises(ValueError, match="mixed_precision must be one of no, bf16, fp16, auto"):
        mini_run(mini_corpus, tmp_path / "refused", mixed_precision="bf32")
    for faster, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(training, "bfloat16_products_are_faster", lambda faster=faster: faster)
        assert training.fastest_mixed_precision(torch.device("cpu")) == expected
    assert training.fastest_mixed_precision(torch.device("meta")) == "no"
    measured, precisions, accelerator = [], [], training.Accelerator
    monkeypatch.setattr(
        training, "Accelerator", lambda **kw: precisions.append(kw["mixed_precision"]) or accelerator(**kw)
    )

    def run(max_steps, measures_as):
        monkeypatch.setattr(training, "fastest_mixed_precision", lambda d: measured.append(d.type) or measures_as)
        config = mini_run(mini_corpus, tmp_path / "run", max_steps=max_steps, save_steps=1, mixed_precision="auto")
        config.resume = True
        return training.train(config)  # each run starts Accelerate's state afresh, as a process of its own would

    output = run(2, measures_as="bf16")
    assert measured == ["cpu"] and precisions == ["bf16"]
    assert json.loads((output / "training_config.json").read_text())["mixed_precision"] == "bf16"
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in read_log(output) if "train_loss" in r)
    # Resumed, the run keeps the precision it started with rather than measuring again...
    run(3, measures_as="no")
    assert measured == ["cpu"] and precisions == ["bf16", "bf16"]
    assert [r["step"] for r in read_log(output) if "train_loss" in r][-1] == 3
    # ... unless its record is unreadable: then it measures again, rather than leave other processes waiting.
    (output / "training_config.json").write_text("{")
    resumed = training.TrainingRun.__new__(training.TrainingRun)
    resumed.config = mini_run(mini_corpus, output, max_steps=4, mixed_precision="auto", resume=True)
    resumed.output_dir, resumed.checkpoints_dir = output, output / "checkpoints"
    assert resumed._resolve_mixed_precision(launched_on_cpus=False) == "no" and measured == ["cpu", "cpu"]


def test_a_run_resumes_only_with_the_settings_it_started_with(mini_corpus, tmp_path):
    from vaswani_transformer import training

    output = training.train(mini_run(mini_corpus, tmp_path / "run", max_steps=2, save_steps=1))
    checkpoints = sorted(p.name for p in (output / "checkpoints").iterdir())
    changed = mini_run(mini_corpus, output, max_steps=3, max_tokens=512, model_overrides={**MINI_MODEL, "d_ff": 128})
    changed.resume, changed.compile = True, True  # compiling pads the batches: another list of them
    # Another precision, and the best checkpoint chosen by BLEU where it was by loss (its best score another measure).
    changed.mixed_precision, changed.bleu_sentences = "bf16", 8
    match = (
        r"--model-option was .*'d_ff': 128.*; --max-tokens was 256, now 512; --compile was False, now True; "
        r"--mixed-precision was 'no', now 'bf16'; --bleu-sentences was 0, now 8\."
    )
    with pytest.raises(ValueError, match=match) as error:
        training.train(changed)
    assert "training_config.json" in str(error.value) and "another --output-dir" in str(error.value)
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == checkpoints  # nothing lost
    # The same corpus spelt another way, another attention implementation (the same function) and a longer budget.
    score = EvalResult(
        task_type="translation", dataset_type="mini", dataset_name="mini", dataset_split="val",
        metric_type="sacrebleu", metric_name="sacreBLEU", metric_value=1.5,
    )  # fmt: skip
    assert ModelCard.load(write_model_card(output, eval_result=score)).data.eval_results == [score]
    eager = {**MINI_MODEL, "attn_implementation": "eager"}
    spelt = str(mini_corpus / ".." / mini_corpus.name)
    # The tokenizer is the one saved beside the checkpoints: --vocab-size has nothing to change.
    resumed = mini_run(mini_corpus, output, data=spelt, max_steps=3, model_overrides=eager, vocab_size=400, resume=True)
    training.train(resumed)
    assert [r["step"] for r in read_log(output) if "train_loss" in r][-1] == 3
    assert ModelCard.load(output / "README.md").data.eval_results is None  # measured on the 2-step weights


@pytest.mark.parametrize("option", [dict(adam_beta1=1.0), dict(adam_beta2=1.5), dict(adam_epsilon=-1.0)])
def test_adam_settings_are_checked_before_the_corpus_is_read(mini_corpus, tmp_path, option):
    with pytest.raises(ValueError, match=f"{next(iter(option))} must .*§5.3"):
        mini_run(mini_corpus, tmp_path / "refused", **option)


def test_checkpoints_by_the_clock_alone_for_a_time_capped_run(mini_corpus, tmp_path):
    from vaswani_transformer import checkpoints as ckpt
    from vaswani_transformer.training import train

    with pytest.raises(ValueError, match="one must be positive"):
        mini_run(mini_corpus, tmp_path / "refused", save_steps=0)
    with pytest.raises(ValueError, match="must not be negative"):
        mini_run(mini_corpus, tmp_path / "refused", save_minutes=-1)
    # A checkpoint every 10^-6 minutes is one after every step, whatever steps save_steps would have chosen.
    config = mini_run(mini_corpus, tmp_path / "run", max_steps=4, save_steps=0, save_minutes=1e-6, keep_checkpoints=4)
    output = train(config)
    assert [path.name for path in ckpt.list_checkpoints(output / "checkpoints")] == [f"step-{i}" for i in range(1, 5)]
    assert "last 2 checkpoints (steps 3 to 4), 1e-06 minutes apart" in (output / "README.md").read_text()
    # Each step logs the rate its update used: Eq. 3 at that step, the peak at the last warm-up step.
    rate = inverse_square_root_schedule(config.model_overrides["d_model"], config.warmup_steps)
    assert [r["learning_rate"] for r in read_log(output)] == [pytest.approx(rate(step - 1)) for step in range(1, 5)]


def test_validation_bleu_drives_best_checkpoint_early_stopping_and_tensorboard(mini_corpus, tmp_path):
    from vaswani_transformer import checkpoints as ckpt
    from vaswani_transformer.training import train

    config = mini_run(mini_corpus, tmp_path / "run", max_steps=40, eval_steps=2, bleu_sentences=8)
    config.early_stopping_patience, config.report_to = 2, ["tensorboard"]
    output = train(config)
    validations = [r for r in read_log(output) if "validation_loss" in r]
    assert all(0.0 <= r["validation_bleu"] <= 100.0 for r in validations)
    # The run stops 2 validations after its best (the first of equal scores: only a better one counts),
    # well before its 40 steps, and keeps the best one's checkpoint.
    bleus = [r["validation_bleu"] for r in validations]
    best = bleus.index(max(bleus))
    assert len(validations) - 1 - best == 2 and validations[-1]["step"] < 40
    best_step = validations[best]["step"]
    state = ckpt.verify_checkpoint(ckpt.list_checkpoints(output / "checkpoints")[-1], world_size=1)
    assert state["best_step"] == best_step and (output / "checkpoints" / f"step-{best_step}").is_dir()
    assert list((output / "runs").rglob("events.out.tfevents.*")), "no TensorBoard event file"


def test_decoding_is_chosen_on_the_whole_validation_set_and_recorded(mini_corpus, tmp_path):
    from vaswani_transformer.inference import load_translator
    from vaswani_transformer.training import train
    from vaswani_transformer.translation import corpus_bleu, translate

    config = mini_run(
        mini_corpus, tmp_path / "run", max_steps=30, choose_num_beams=[1, 3], choose_length_penalty=[0.0, 2.0]
    )
    output = train(config)
    choice = json.loads((output / "training_config.json").read_text())["decoding_choice"]
    tried = choice["tried"]
    assert [(t["num_beams"], t["length_penalty"]) for t in tried] == [(1, None), (3, 0.0), (3, 2.0)]
    assert choice["bleu"] == max(t["bleu"] for t in tried) and choice["sentences"] == 100
    generation = json.loads((output / "generation_config.json").read_text())
    assert generation["num_beams"] == choice["num_beams"]
    assert generation.get("length_penalty", 1.0) == (choice["length_penalty"] or 1.0)
    # The recorded score is the saved model's, with its saved decoding, on the validation set.
    model, tokenizer = load_translator(str(output), "cpu")
    sources = (mini_corpus / "val.en").read_text(encoding="utf-8").splitlines()
    references = (mini_corpus / "val.de").read_text(encoding="utf-8").splitlines()
    assert round(corpus_bleu(translate(model, tokenizer, sources), references)["score"], 2) == choice["bleu"]
    assert (
        f"the best of 3 settings by sacreBLEU on 100 validation sentences ({choice['bleu']})"
        in (output / "README.md").read_text()
    )


def test_two_runs_in_one_python_session_may_train_in_different_precisions(mini_corpus, tmp_path):
    # A notebook trains in float32, then in bf16: Accelerate's per-process state would refuse the second.
    from vaswani_transformer.training import train

    for precision in ("no", "bf16"):
        output = train(mini_run(mini_corpus, tmp_path / precision, max_steps=3, mixed_precision=precision))
        assert AcceleratorState().mixed_precision == precision  # what the run trained in, not only what it recorded
        assert json.loads((output / "training_config.json").read_text())["mixed_precision"] == precision
        assert (output / "model.safetensors").is_file()


@pytest.mark.parametrize("damage", ['{"source_lang": "en", "targ', "[]", None], ids=["cut off", "no object", "deleted"])
def test_a_training_config_damaged_during_the_run_does_not_cost_the_averaged_model(
    mini_corpus, tmp_path, monkeypatch, damage
):
    # The decoding choice is added to training_config.json after training: a file cut off or deleted in the
    # meantime is rewritten from the run's settings, and the averaged model is saved all the same.
    from vaswani_transformer import training

    finish = training.TrainingRun.finish

    def finish_after_damage(run):
        record = run.output_dir / "training_config.json"
        record.write_text(damage) if damage is not None else record.unlink()
        return finish(run)

    monkeypatch.setattr(training.TrainingRun, "finish", finish_after_damage)
    output = training.train(mini_run(mini_corpus, tmp_path / "run", max_steps=6, choose_num_beams=[1, 2]))
    recorded = json.loads((output / "training_config.json").read_text())
    assert recorded["target_lang"] == "de" and recorded["max_steps"] == 6
    assert [t["num_beams"] for t in recorded["decoding_choice"]["tried"]] == [1, 2]
    assert (output / "model.safetensors").is_file() and (output / "generation_config.json").is_file()


def test_compiled_training_follows_eager_training_and_logs_model_flops(mini_corpus, tmp_path, monkeypatch):
    # torch.compile (dynamic shapes, lengths padded to multiples of 8) computes the same steps to float rounding.
    from vaswani_transformer import training
    from vaswani_transformer.training import train

    # The same batches: the eager run padded as the compiled one is, the padding counted in the token budget.
    batches = training._batches
    monkeypatch.setattr(training, "_batches", lambda *args, pad_to=1: batches(*args[:6], pad_to=8))
    settings = dict(model_overrides={**mini_run(mini_corpus, "-").model_overrides, "dropout": 0.0}, max_steps=4)
    eager = read_log(train(mini_run(mini_corpus, tmp_path / "eager", **settings)))
    monkeypatch.undo()
    compiled = read_log(train(mini_run(mini_corpus, tmp_path / "compiled", compile=True, peak_tflops=0.5, **settings)))
    assert AcceleratorState().dynamo_plugin.backend.value.lower() == "inductor"  # not the eager run's state
    assert [r["step"] for r in compiled] == [1, 2, 3, 4]
    for ours, theirs in zip(compiled, eager, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], abs=1e-4)
        assert ours["model_tflops_per_second"] > 0
        assert "mfu" not in theirs  # no peak is known for a CPU
        # the MFU is the model's FLOP/s over the peak given
        assert ours["mfu"] == pytest.approx(ours["model_tflops_per_second"] / 0.5, rel=0.05, abs=1e-4)


def test_a_given_tokenizer_takes_the_runs_max_length(tokenizer, tmp_path):
    from vaswani_transformer.training import _prepare_tokenizer

    tokenizer.save_pretrained(tmp_path)  # saved with its own model_max_length
    max_length = tokenizer.model_max_length + 64
    config = TrainingConfig(data="unused", source_lang="en", target_lang="de", output_dir=str(tmp_path / "run"),
                            tokenizer=str(tmp_path), max_length=max_length, max_steps=1)  # fmt: skip
    assert _prepare_tokenizer(config, None, resuming=False).model_max_length == max_length, "translation truncates"


def test_a_run_resumes_on_its_corpus_as_it_was_or_with_allow_data_change(multi30k_dir, tmp_path, capsys):
    from conftest import cli_arguments, make_corpus

    from vaswani_transformer.cli import main
    from vaswani_transformer.training import train

    corpus = make_corpus(multi30k_dir, tmp_path / "corpus", 400)
    output = train(mini_run(corpus, tmp_path / "run", max_steps=3, save_steps=3))
    # The same path, the same size, one letter changed in place.
    train_en = corpus / "train.en"
    text = train_en.read_text(encoding="utf-8")
    train_en.write_text(text.replace("A", "a", 1), encoding="utf-8")
    assert train_en.stat().st_size == len(text.encode("utf-8"))
    assert main(cli_arguments(mini_run(corpus, output, max_steps=6, resume=True))) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("vaswani-transformer train: error: Cannot resume the run in") and "Traceback" not in error
    assert "train.en changed since the run started (same size, another SHA-256)" in error
    assert "--allow-data-change" in error and read_log(output)[-1]["step"] == 3
    # Allowed, the run continues on the new data and records it: the next resume compares with that.
    train(mini_run(corpus, output, max_steps=6, resume=True, allow_data_change=True))
    assert read_log(output)[-1]["step"] == 6
    train(mini_run(corpus, output, max_steps=7, resume=True))
    assert read_log(output)[-1]["step"] == 7
    (corpus / "val.de").write_text("Ein Hund.\n" * 100, encoding="utf-8")  # another size
    with pytest.raises(ValueError, match=r"val.de changed since the run started \(\d+ bytes, now 1000\)"):
        train(mini_run(corpus, output, max_steps=8, resume=True))
