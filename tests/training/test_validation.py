"""Validation in a run: loss and BLEU (§6.1), the best checkpoint kept, early stopping."""

from conftest import mini_run, read_log


def test_validation_bleu_drives_best_checkpoint_early_stopping_and_tensorboard(mini_corpus, tmp_path):
    from vaswani_transformer.training import checkpoints as ckpt
    from vaswani_transformer.training.run import train

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
