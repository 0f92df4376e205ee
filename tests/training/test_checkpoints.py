"""Checkpoints: atomic, complete, safe to load, and a killed run resumes to the very same parameters."""

import errno
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import Exploit, cli_arguments, mini_run, one_line_error, read_log
from safetensors import SafetensorError
from safetensors.torch import load_file

import vaswani_transformer.model.modeling_vaswani as modeling
from vaswani_transformer.cli import main
from vaswani_transformer.training import checkpoints as ckpt
from vaswani_transformer.training.run import NonFiniteLossError, train


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def assert_bitwise_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    different = [name for name in left if not torch.equal(left[name], right[name])]
    assert not different, f"parameters differ: {different}"


@pytest.fixture(scope="module")
def uninterrupted(mini_corpus, tmp_path_factory) -> Path:
    return train(mini_run(mini_corpus, tmp_path_factory.mktemp("uninterrupted")))


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_checkpoint_weights_round_trip_with_the_output_projection_tied_or_not(tie_word_embeddings):
    config = modeling.VaswaniConfig.from_preset("tiny", vocab_size=64, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    trained = modeling.VaswaniForConditionalGeneration(config)
    torch.manual_seed(1)
    fresh = modeling.VaswaniForConditionalGeneration(config)
    state = ckpt.model_state(trained)
    assert ("lm_head.weight" in state) is not tie_word_embeddings, "an untied projection is a weight of its own"
    assert not any(name.endswith("embed_tokens.weight") for name in state), "the embeddings are model.shared"
    ckpt.load_model_state(fresh, state)
    assert_bitwise_equal(fresh.state_dict(), trained.state_dict())


def test_a_checkpoint_holds_the_whole_training_state_and_its_checksums(uninterrupted):
    saved = ckpt.list_checkpoints(uninterrupted / "checkpoints")
    # The last `average_last` (2 of the checkpoints every 3 steps) and the best by validation loss.
    best = min((r for r in read_log(uninterrupted) if "validation_loss" in r), key=lambda r: r["validation_loss"])
    assert [ckpt.checkpoint_step(p) for p in saved] == sorted({9, 12, best["step"]})
    state = ckpt.verify_checkpoint(saved[-1], world_size=1)
    assert state["step"] == 12 and state["epoch"] >= 0 and state["batches_done"] > 0
    assert set(state["files"]) == {"model.safetensors", "optimizer.pt", "rng-0.safetensors"}
    optimizer = ckpt.load_optimizer_state(saved[-1])
    assert optimizer["scheduler"]["last_epoch"] == 12 and len(optimizer["optimizer"]["state"]) > 0
    assert not list((uninterrupted / "checkpoints").glob(".*")), "no leftovers of the atomic writes"


def test_weights_are_readable_by_whoever_may_read_the_other_files(uninterrupted):
    # safetensors writes through a temporary file of mode 0600; every file gets the mode the umask gives (0644 here).
    def modes(directory: Path) -> dict[str, int]:
        return {path.name: stat.S_IMODE(path.stat().st_mode) for path in directory.iterdir() if path.is_file()}

    for directory in (uninterrupted, *ckpt.list_checkpoints(uninterrupted / "checkpoints")):
        found = modes(directory)
        assert len(set(found.values())) == 1, f"{directory}: {found}"


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, f"the run ended (status {process.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_a_full_disk_at_a_checkpoint_stops_the_run_in_one_line_and_resume_recovers_bitwise(
    mini_corpus, uninterrupted, tmp_path, monkeypatch, capsys
):
    # The writers of safetensors and torch report a full disk in errors of their own, with no errno.
    save_file = ckpt.save_file

    def disk_full_at_step_6(tensors, path, *args, **kwargs):
        if ".incomplete-step-6" in str(path):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", disk_full_at_step_6)
    run = tmp_path / "run"
    status = main(cli_arguments(mini_run(mini_corpus, run)))
    error = one_line_error(status, capsys.readouterr().err)
    assert f"No space left in {run} for checkpoint step-6: it needs about 0." in error, error
    assert "MB free" in error and "run the same command with --resume: it continues from step-3" in error, error
    monkeypatch.undo()
    assert main([*cli_arguments(mini_run(mini_corpus, run)), "--resume"]) == 0
    assert_bitwise_equal(weights(run), weights(uninterrupted))
    assert [r["step"] for r in read_log(run)] == list(range(1, 13))
    # A write that fails with ENOSPC itself (torch, Python's own files) is the same line.
    monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    assert main(cli_arguments(mini_run(mini_corpus, tmp_path / "other"))) == 2
    assert "No space left in" in one_line_error(2, capsys.readouterr().err)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real file system of 1 MiB (a tmpfs), where this process may mount one (root on Linux)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    # Lazily: a failed test's traceback may still hold a file open in it.
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def test_a_run_on_a_disk_too_small_for_its_checkpoints_stops_in_one_line_and_resumes_once_there_is_room(
    mini_corpus, uninterrupted, small_tmpfs, capsys
):
    run = small_tmpfs / "run"
    status = main(cli_arguments(mini_run(mini_corpus, run)))
    error = one_line_error(status, capsys.readouterr().err)
    assert f"No space left in {run} for checkpoint step-" in error and "MB free, and 0." in error, error
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)
    assert main([*cli_arguments(mini_run(mini_corpus, run)), "--resume"]) == 0
    assert_bitwise_equal(weights(run), weights(uninterrupted))


def test_a_second_run_into_the_same_output_directory_is_refused_while_the_first_lives(mini_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "vaswani_transformer.cli", *cli_arguments(mini_run(mini_corpus, run, max_steps=10**6))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(run / "checkpoints" / "step-3", first)
        for resume in ([], ["--resume"]):
            status = main([*cli_arguments(mini_run(mini_corpus, run, max_steps=5)), *resume])
            error = one_line_error(status, capsys.readouterr().err)
            assert f"Cannot train in {run}: another train run is writing to it" in error, error
            assert "another --output-dir" in error
    finally:
        first.kill()  # SIGKILL: its lock is left behind, held by no process
        first.wait()
    # The lock of a process that died holds nothing back, and a run releases its own whenever it ends.
    last = ckpt.checkpoint_step(ckpt.list_checkpoints(run / "checkpoints")[-1])
    assert main([*cli_arguments(mini_run(mini_corpus, run, max_steps=last + 3)), "--resume"]) == 0
    assert read_log(run)[-1]["step"] == last + 3
    assert main([*cli_arguments(mini_run(mini_corpus, run, max_steps=last + 4)), "--resume", "--max-tokens", "1"]) == 2
    assert "--max-tokens was 256, now 1" in capsys.readouterr().err  # refused after taking the lock
    assert main([*cli_arguments(mini_run(mini_corpus, run, max_steps=last + 4)), "--resume"]) == 0


def test_ctrl_c_stops_training_in_one_line_that_says_how_to_resume(mini_corpus, tmp_path):
    run, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    arguments = cli_arguments(mini_run(mini_corpus, run, max_steps=10**6))
    command = [sys.executable, "-m", "vaswani_transformer.cli", *arguments]
    with stderr.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(run / "checkpoints" / "step-3", process)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    finally:
        process.kill()
    error = one_line_error(process.returncode, stderr.read_text(), expected_status=130)
    last = ckpt.list_checkpoints(run / "checkpoints")[-1]
    assert error == (
        f"vaswani-transformer train: interrupted; the last checkpoint is {last}: run the same command with --resume "
        "to continue from it."
    )


def test_publishing_keeps_the_newest_checkpoints_and_refuses_to_keep_none(uninterrupted, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", checkpoints)
    incomplete = checkpoints / ".incomplete-step-15"
    shutil.copytree(checkpoints / "step-12", incomplete)
    before = ckpt.list_checkpoints(checkpoints)
    with pytest.raises(ValueError, match="keep must be at least 1"):
        ckpt.publish_checkpoint(incomplete, keep=0)
    assert incomplete.is_dir() and ckpt.list_checkpoints(checkpoints) == before
    assert ckpt.publish_checkpoint(incomplete, keep=1, protect=(9,)) == checkpoints / "step-15"
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(checkpoints)] == [9, 15]


def test_what_a_killed_run_left_half_written_or_half_deleted_is_removed_and_nothing_else(uninterrupted, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", checkpoints)
    complete = ckpt.list_checkpoints(checkpoints)
    half_written, half_deleted = checkpoints / ".incomplete-step-15", checkpoints / ".deleting-step-6"
    shutil.copytree(complete[-1], half_written)
    shutil.copytree(complete[0], half_deleted)
    (checkpoints / "notes.txt").write_text("the user's")
    assert sorted(ckpt.remove_leftovers(checkpoints)) == sorted([half_written, half_deleted])
    assert not half_written.exists() and not half_deleted.exists()
    assert ckpt.list_checkpoints(checkpoints) == complete and (checkpoints / "notes.txt").read_text() == "the user's"
    assert ckpt.remove_leftovers(checkpoints) == []


def test_a_checkpoint_resumes_only_with_the_number_of_processes_that_wrote_it(uninterrupted, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", checkpoints)
    newest = ckpt.list_checkpoints(checkpoints)[-1]
    with pytest.raises(ckpt.CheckpointError, match=r"written by 1 processes, not 2: resume with .* \(1\)"):
        ckpt.verify_checkpoint(newest, world_size=2)
    for path in ckpt.list_checkpoints(checkpoints):  # as if two processes had written them (their RNG files aside)
        state = json.loads((path / ckpt.STATE_NAME).read_text())
        (path / ckpt.STATE_NAME).write_text(json.dumps({**state, "world_size": 2}))
    with pytest.raises(ckpt.CheckpointError, match=r"written by 2 processes, not 1") as refused:
        ckpt.latest_good_checkpoint(checkpoints, world_size=1)
    assert "damaged" not in str(refused.value)


def test_a_run_killed_at_a_random_step_resumes_to_the_same_parameters_bitwise(mini_corpus, uninterrupted, tmp_path):
    config = mini_run(mini_corpus, tmp_path / "killed")
    kill_after = random.randint(1, 3) * config.save_steps  # a checkpoint exists, later steps are lost
    process = subprocess.Popen(
        [sys.executable, "-m", "vaswani_transformer.cli", *cli_arguments(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / f"step-{kill_after}").exists() and process.poll() is None:
        assert time.monotonic() < deadline, "the training run did not reach its checkpoint"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, f"the run ended before it was killed (after step {kill_after})"
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    # A run that never finished can still be averaged: its config.json was written when it started.
    assert main(["average", str(tmp_path / "killed"), "--last", "1", "--output-dir", str(tmp_path / "avg")]) == 0
    averaged, last = weights(tmp_path / "avg"), ckpt.load_weights(ckpt.list_checkpoints(checkpoints)[-1])
    assert_bitwise_equal(averaged, {name: last[name] for name in averaged})

    # Killed while appending to its log, a run leaves half a record there: the resumed run leaves it out.
    with open(tmp_path / "killed" / "training_log.jsonl", "a", encoding="utf-8") as log_file:
        log_file.write('{"step": 99, "train_lo')
    resumed = train(mini_run(mini_corpus, tmp_path / "killed", resume=True))
    assert_bitwise_equal(weights(resumed), weights(uninterrupted))
    last = ckpt.list_checkpoints(checkpoints)[-1]
    assert_bitwise_equal(ckpt.load_weights(last), ckpt.load_weights(uninterrupted / "checkpoints" / "step-12"))
    log = [json.loads(line) for line in (resumed / "training_log.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (uninterrupted / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13)), "a resumed run logs every step exactly once"
    assert [r["train_loss"] for r in log] == [r["train_loss"] for r in reference]


def test_a_new_run_refuses_to_overwrite_the_checkpoints_of_another(uninterrupted, mini_corpus, capsys):
    status = main(cli_arguments(mini_run(mini_corpus, uninterrupted)))
    assert status == 2
    error = capsys.readouterr().err
    assert "already holds the checkpoints" in error and "--resume" in error and "step-12" in error


def test_a_new_run_refuses_to_overwrite_a_trained_model_without_checkpoints(
    uninterrupted, mini_corpus, tmp_path, capsys
):
    finished = tmp_path / "finished"
    shutil.copytree(uninterrupted, finished)
    shutil.rmtree(finished / "checkpoints")
    before = (finished / "model.safetensors").read_bytes()
    for resume in (False, True):  # with --resume too: there is nothing to resume from
        assert main(cli_arguments(mini_run(mini_corpus, finished, resume=resume))) == 2
        assert "already holds a trained model" in capsys.readouterr().err
    assert (finished / "model.safetensors").read_bytes() == before
    # Nor a model saved in PyTorch's pickle format (or a user's directory of one), whose config.json a run rewrites.
    (finished / "model.safetensors").rename(finished / "pytorch_model.bin")
    config_before = (finished / "config.json").read_bytes()
    assert main(cli_arguments(mini_run(mini_corpus, finished))) == 2
    assert "already holds a trained model (pytorch_model.bin)" in capsys.readouterr().err
    assert (finished / "config.json").read_bytes() == config_before


@pytest.mark.parametrize("budget", [dict(max_steps=None, max_minutes=0.02), dict(eval_steps=2, bleu_sentences=8)])
def test_a_finished_run_resumed_again_only_finishes(mini_corpus, tmp_path, budget):
    # The recipes run the same command again after an interruption: once the run's minutes or early stopping's
    # patience are spent, it trains no further and keeps its checkpoints (the best one among them).
    config = mini_run(mini_corpus, tmp_path / "run", resume=True, **{"max_steps": 40, **budget})
    if "bleu_sentences" in budget:
        config.early_stopping_patience = 2
    output = train(config)
    checkpoints, log, model = ckpt.list_checkpoints(output / "checkpoints"), read_log(output), weights(output)
    assert log[-1]["step"] < 40 if config.max_steps else log[-1]["minutes"] >= 0.02  # ended by the budget asked for
    train(config)
    assert ckpt.list_checkpoints(output / "checkpoints") == checkpoints and read_log(output) == log
    assert_bitwise_equal(weights(output), model)


def test_a_damaged_checkpoint_is_detected_before_training_and_the_last_good_one_named(
    mini_corpus, uninterrupted, tmp_path, capsys
):
    run = tmp_path / "damaged"
    os.system(f"cp -r {uninterrupted} {run}")
    latest = run / "checkpoints" / "step-12" / "model.safetensors"
    data = bytearray(latest.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the weights
    latest.write_bytes(bytes(data))
    status = main([*cli_arguments(mini_run(mini_corpus, run, max_steps=15)), "--resume"])
    assert status == 2
    error = capsys.readouterr().err
    assert "step-12 is damaged" in error and "model.safetensors" in error
    assert f"The last good checkpoint is {run / 'checkpoints' / 'step-9'}" in error

    (run / "checkpoints" / "step-9" / "rng-0.safetensors").unlink()  # now no intact checkpoint is left
    assert main([*cli_arguments(mini_run(mini_corpus, run, max_steps=15)), "--resume"]) == 2
    assert "No older checkpoint is intact" in capsys.readouterr().err


def test_a_crafted_pickle_where_a_checkpoint_is_expected_is_refused_not_executed(uninterrupted, tmp_path):
    checkpoint = tmp_path / "step-12"
    os.system(f"cp -r {uninterrupted / 'checkpoints' / 'step-12'} {checkpoint}")
    marker = tmp_path / "exploited"
    torch.save({"optimizer": Exploit(marker)}, checkpoint / "optimizer.pt")
    with pytest.raises(ckpt.CheckpointError, match="not a safe optimizer state"):
        ckpt.load_optimizer_state(checkpoint)
    (checkpoint / "model.safetensors").write_bytes((checkpoint / "optimizer.pt").read_bytes())
    with pytest.raises(ckpt.CheckpointError, match="not a valid safetensors file"):
        ckpt.load_weights(checkpoint)
    assert not marker.exists(), "the pickled code ran"


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(mini_corpus, tmp_path, monkeypatch):
    real_loss, calls = modeling.linear_label_smoothed_cross_entropy, []

    def loss_turning_nan_at_step_8(*args, **kwargs):
        calls.append(1)
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if len(calls) == 8 else loss

    monkeypatch.setattr(modeling, "linear_label_smoothed_cross_entropy", loss_turning_nan_at_step_8)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 8.*Last good checkpoint: .*step-6"):
        train(mini_run(mini_corpus, tmp_path / "stopped", eval_steps=100))
    kept = ckpt.list_checkpoints(tmp_path / "stopped" / "checkpoints")
    assert [ckpt.checkpoint_step(p) for p in kept] == [3, 6]
    assert torch.isfinite(torch.cat([t.flatten() for t in ckpt.load_weights(kept[-1]).values()])).all()

    calls.clear()
    output = train(mini_run(mini_corpus, tmp_path / "skipped", eval_steps=100, skip_nonfinite=True))
    log = [json.loads(line) for line in (output / "training_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 12 and log[-1]["skipped_nonfinite"] == 1
    assert torch.isfinite(torch.cat([t.flatten() for t in weights(output).values()])).all()


def test_average_command_writes_a_loadable_model_of_the_mean_weights(uninterrupted, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    assert main(["average", str(uninterrupted), "--last", "2", "--output-dir", str(tmp_path / "averaged")]) == 0
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "averaged")
    nine, twelve = (ckpt.load_weights(uninterrupted / "checkpoints" / f"step-{s}") for s in (9, 12))
    name = "model.encoder.layers.0.feed_forward.w_1.weight"
    if name not in nine:
        name = next(n for n in nine if n.endswith("weight") and nine[n].dim() == 2 and "shared" not in n)
    torch.testing.assert_close(model.state_dict()[name], (nine[name] + twelve[name]) / 2)
    # The new directory says what it translates (`serve` reads that) and which checkpoints it averages.
    from vaswani_transformer.serving.app import model_languages

    assert model_languages(str(tmp_path / "averaged")) == ("en", "de")
    assert json.loads((tmp_path / "averaged" / "training_config.json").read_text())["averaged_steps"] == [9, 12]
    assert "last 2 checkpoints (steps 9 to 12)" in (tmp_path / "averaged" / "README.md").read_text()
    assert main(["average", str(uninterrupted), "--last", "9"]) == 2
    # A file where the model should go: refused (transformers' save_pretrained only logs it and writes nothing).
    (tmp_path / "a-file").write_text("")
    assert main(["average", str(uninterrupted), "--last", "2", "--output-dir", str(tmp_path / "a-file")]) == 2
    assert (tmp_path / "a-file").read_text() == ""


def test_average_never_writes_over_another_run_or_model(uninterrupted, tmp_path, capsys):
    other = shutil.copytree(uninterrupted, tmp_path / "other-run")
    before = {path.name: path.read_bytes() for path in other.iterdir() if path.is_file()}
    assert main(["average", str(uninterrupted), "--last", "2", "--output-dir", str(other)]) == 2
    assert "already holds checkpoints, config.json, model.safetensors, tokenizer.json" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in other.iterdir() if path.is_file()} == before
    # An empty directory, or the run's own (given by name), is fine.
    (tmp_path / "empty").mkdir()
    assert main(["average", str(uninterrupted), "--last", "2", "--output-dir", str(tmp_path / "empty")]) == 0
    assert main(["average", str(other), "--last", "2", "--output-dir", str(other)]) == 0


def test_checkpoints_that_do_not_fit_the_config_are_named_in_one_line(uninterrupted, tmp_path, capsys):
    run = shutil.copytree(uninterrupted, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config["vocab_size"] += 20  # another run's config.json, copied beside these checkpoints
    (run / "config.json").write_text(json.dumps(config))
    assert main(["average", str(run), "--last", "2"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "do not fit the model its config.json describes" in error, error


def test_the_card_names_the_checkpoints_the_weights_average(uninterrupted, tmp_path):
    from huggingface_hub import ModelCard

    from vaswani_transformer.exchange.model_card import write_model_card

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    steps = [ckpt.checkpoint_step(path) for path in ckpt.list_checkpoints(run / "checkpoints")]

    def recorded() -> list[int]:
        return json.loads((run / "training_config.json").read_text())["averaged_steps"]

    assert recorded() == steps[-2:]  # the run's end averaged its last `average_last` = 2
    assert f"last 2 checkpoints (steps {steps[-2]} to {steps[-1]})" in ModelCard.load(run / "README.md").text
    assert main(["average", str(run), "--last", "1"]) == 0
    assert recorded() == steps[-1:]
    card = ModelCard.load(write_model_card(run)).text  # as `evaluate` rewrites it, from the run's records
    assert f"none (the checkpoint of step {steps[-1]} alone)" in card and "last 2 checkpoints" not in card


def test_average_keeps_the_decoding_the_run_chose(uninterrupted, tmp_path):
    from transformers import GenerationConfig

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    chosen = GenerationConfig.from_pretrained(run)
    chosen.num_beams, chosen.length_penalty = 6, 1.4  # as --choose-num-beams / --choose-length-penalty would set
    chosen.save_pretrained(run)
    assert main(["average", str(run), "--last", "2"]) == 0
    kept = GenerationConfig.from_pretrained(run)
    assert (kept.num_beams, kept.length_penalty) == (6, 1.4)


def test_average_names_a_checkpoint_whose_record_is_unreadable(uninterrupted, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    record = ckpt.list_checkpoints(run / "checkpoints")[-1] / ckpt.STATE_NAME
    record.write_text("{")
    assert main(["average", str(run), "--last", "2"]) == 2
    assert f"{record} is missing or unreadable" in capsys.readouterr().err


def test_average_drops_the_scores_of_the_weights_it_replaces(uninterrupted, tmp_path):
    from huggingface_hub import EvalResult, ModelCard

    from vaswani_transformer.exchange.model_card import write_model_card

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    score = dict(dataset_type="multi30k", dataset_name="multi30k", dataset_split="test", metric_type="sacrebleu")
    write_model_card(run, eval_result=EvalResult(task_type="translation", metric_value=12.3, **score))
    assert ModelCard.load(run / "README.md").data.eval_results, "as `evaluate` records a score"
    assert main(["average", str(run), "--last", "2"]) == 0
    card = ModelCard.load(run / "README.md")
    assert not card.data.eval_results and "12.3" not in card.text
    assert card.data.language == ["en", "de"], "the rest of the card stays"


def test_average_reads_checkpoints_whatever_number_of_processes_wrote_them(uninterrupted, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    record = ckpt.list_checkpoints(run / "checkpoints")[-2] / ckpt.STATE_NAME
    record.write_text(json.dumps({**json.loads(record.read_text()), "world_size": 2}))  # a run resumed on 1 of 2
    assert main(["average", str(run), "--last", "2"]) == 0
