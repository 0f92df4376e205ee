"""The output directory of a `train` run: held by one run at a time, never trained over, and the run's record.

A run writes its model, tokenizer, log and checkpoints there, and `training_config.json`: its settings as it
started, which a resumed run must find again (`TrainingConfig.check_resumes`).
"""

import contextlib
import json
import logging
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from filelock import FileLock, Timeout
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from ..utils.files import TRAINING_LOCK_NAME
from . import checkpoints as ckpt

logger = logging.getLogger(__name__)


def check_output_dir(output_dir: Path, resume: bool) -> None:
    """Refuse to start a new run over another run's checkpoints, or over a trained model.

    Args:
        output_dir: the run's output directory.
        resume: whether the run continues the one whose checkpoints are there (`--resume`).

    Raises:
        ValueError: `output_dir` holds checkpoints and `resume` is off, or a model and no checkpoints; the
            message says which, and how to go on.
    """
    existing = ckpt.list_checkpoints(output_dir / "checkpoints")
    if existing and not resume:
        raise ValueError(
            f"{output_dir} already holds the checkpoints of a run (latest: {existing[-1].name}). Pass --resume to "
            "continue it, or choose another --output-dir: a new run would overwrite them."
        )
    model_files = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, "tf_model.h5")
    if not existing and (held := [name for name in model_files if (output_dir / name).is_file()]):
        raise ValueError(
            f"{output_dir} already holds a trained model ({held[0]}) and no checkpoints to resume from. "
            "Choose another --output-dir, or remove the model: a new run would overwrite it."
        )


def hold_output_dir(accelerator: Accelerator, output_dir: Path, held: contextlib.ExitStack) -> None:
    """Hold `output_dir` against other runs until `held` closes: the main process locks OUTPUT_DIR/.train.lock.

    The lock is the operating system's (flock, through filelock): the kernel releases the lock of a process
    that ends, killed too, so no stale lock is ever held. Every process must call this.

    Args:
        accelerator: the run's processes; every one stops alike when the lock is held elsewhere.
        output_dir: the run's output directory (it exists).
        held: where the lock is kept until the run lets it go.

    Raises:
        OSError: another run holds the directory (the message names the lock file and how to go on).
    """
    refusal = [None]
    if accelerator.is_main_process:
        lock = output_dir / TRAINING_LOCK_NAME
        try:
            held.enter_context(FileLock(lock, timeout=0))
        except Timeout:
            refusal = [
                f"Cannot train in {output_dir}: another train run is writing to it (it holds {lock}). Wait "
                "for that run to end, or choose another --output-dir."
            ]
    if accelerator.num_processes > 1:  # every process stops alike
        refusal = broadcast_object_list(refusal)
    if refusal[0]:
        raise OSError(refusal[0])


def read_record(output_dir: Path) -> dict:
    """The run's `training_config.json` as its start wrote it.

    Args:
        output_dir: the run's output directory.

    Returns:
        The record; {} (with a warning) where the file is gone, unreadable or holds no JSON object.
    """
    path = output_dir / "training_config.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("%s is unreadable: %r", path, error)
        return {}
    if not isinstance(record, dict):
        logger.warning("%s holds no JSON object: %.60r", path, record)
        return {}
    return record
