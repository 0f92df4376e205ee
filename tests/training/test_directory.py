"""The output directory of a run: one run at a time holds it, none trains over another's work, its record read."""

import contextlib
import logging

import pytest
from accelerate import PartialState

from vaswani_transformer.training.directory import check_output_dir, hold_output_dir, read_record


def test_one_run_at_a_time_holds_an_output_directory_until_it_lets_go(tmp_path):
    processes = PartialState(cpu=True)
    with contextlib.ExitStack() as first:
        hold_output_dir(processes, tmp_path, first)
        with pytest.raises(OSError, match=r"another train run is writing to it \(it holds .*\.train\.lock\)"):
            hold_output_dir(processes, tmp_path, contextlib.ExitStack())
    with contextlib.ExitStack() as second:  # the first let go: the directory is free again
        hold_output_dir(processes, tmp_path, second)


def test_a_new_run_never_trains_over_checkpoints_or_a_model(tmp_path):
    check_output_dir(tmp_path, resume=False)  # empty: a new run
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"already holds a trained model \(model.safetensors\) and no checkpoints"):
        check_output_dir(tmp_path, resume=True)
    (tmp_path / "checkpoints" / "step-12").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"already holds the checkpoints of a run \(latest: step-12\)\. Pass --resume"):
        check_output_dir(tmp_path, resume=False)
    check_output_dir(tmp_path, resume=True)  # resuming: the checkpoints are its own


@pytest.mark.parametrize(
    ("text", "warning"),
    [(None, "is unreadable"), ('{"seed": 1', "is unreadable"), ("[1]", "holds no JSON object")],
    ids=["missing", "cut off", "no object"],
)
def test_a_record_that_cannot_be_read_is_empty_with_a_warning(tmp_path, caplog, text, warning):
    if text is not None:
        (tmp_path / "training_config.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        assert read_record(tmp_path) == {}
    assert warning in caplog.text
    (tmp_path / "training_config.json").write_text('{"seed": 1}')
    assert read_record(tmp_path) == {"seed": 1}
