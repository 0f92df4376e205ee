"""Training checkpoints that survive a crash at any moment and load without running pickled code.

A checkpoint is a directory `checkpoints/step-<N>/` holding everything needed to continue a run
exactly: the weights (`model.safetensors`), the optimizer, scheduler and loss-scaler states
(`optimizer.pt`, plain tensors and numbers only, read with `torch.load(weights_only=True)`), every
process's random number generator state (`rng-<rank>.safetensors`), and `trainer_state.json`
(step, position in the data, log, best score) with the SHA-256 of every other file.

The weights are always the whole model in float32, whatever the processes held: under FSDP they
are gathered from the shards, and so is the optimizer state (keyed by parameter name, as
`torch.distributed.checkpoint.state_dict` writes it); under DeepSpeed ZeRO they are ZeRO's float32
master weights, and each process writes its partition of the optimizer (`optimizer-<rank>.pt`:
the master weights and Adam moments of its share, plain tensors and numbers too).

Writes are atomic: the files go into a hidden `.incomplete-*` directory that is renamed to
`step-<N>` only once everything is on disk (renaming a directory is atomic on POSIX file
systems), and old checkpoints are renamed to `.deleting-*` before they are removed. So a run
killed at any moment leaves complete checkpoints and hidden leftovers, which the next run removes.

A disk too full for a checkpoint stops the run in one line that says how much room it needs
(`room_for`); the run then resumes from its last checkpoint once there is room.

`average_run_checkpoints` averages a run's last checkpoints into a model that `from_pretrained`
loads (§6.1).
"""

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME

from ..exchange.model_card import write_model_card
from ..exchange.saving import save_translator
from ..model.configuration_vaswani import VaswaniConfig
from ..model.modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel
from ..utils.files import ensure_writable, give_umask_mode, sha256_file, write_text_atomically

logger = logging.getLogger(__name__)
WEIGHTS_NAME = "model.safetensors"
OPTIMIZER_NAME = "optimizer.pt"
STATE_NAME = "trainer_state.json"
_PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, damaged, or not a checkpoint of this package.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """


class _ProcessCountError(CheckpointError):
    # A sound checkpoint of another number of processes: not damaged, so no older one is better.
    pass


def checkpoint_step(path: Path) -> int:
    """The optimizer step of a checkpoint directory named `step-<N>`.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """
    return int(path.name[len(_PREFIX) :])


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """The complete (renamed into place) checkpoints under `checkpoints_dir`, oldest first.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted((p for p in found if p.name[len(_PREFIX) :].isdigit()), key=checkpoint_step)


def remove_leftovers(checkpoints_dir: str | Path) -> list[Path]:
    """Delete what a killed run left: half-written (`.incomplete-*`) and half-deleted (`.deleting-*`) checkpoints.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Returns:
        The removed paths.
    """
    checkpoints_dir = Path(checkpoints_dir)
    leftovers = [*checkpoints_dir.glob(".incomplete-*"), *checkpoints_dir.glob(".deleting-*")]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def _tied_copies(config: VaswaniConfig) -> tuple[str, ...]:
    # The encoder's and decoder's token embeddings are the module `model.shared` itself, and the pre-softmax
    # projection shares its weight unless the config unties it (§3.4): the names of these copies, as the model
    # declares them to transformers, matched at the end so that a wrapper's prefix shows them.
    prefix = VaswaniForConditionalGeneration.base_model_prefix
    copies = tuple(f"{prefix}.{name}" for name in VaswaniModel._tied_weights_keys)
    if config.tie_word_embeddings:
        copies += tuple(VaswaniForConditionalGeneration._tied_weights_keys)
    return copies


def model_state(
    model: torch.nn.Module | dict[str, torch.Tensor], config: VaswaniConfig | None = None
) -> dict[str, torch.Tensor]:
    """The model's weights for a checkpoint, each stored once, on the CPU.

    The embedding shared by source, target and (unless `tie_word_embeddings` is False) the pre-softmax
    projection (§3.4) is stored under `model.shared.weight` only: safetensors refuses tensors that share memory.

    Args:
        model: the unwrapped model, or the whole state dict of one (e.g. gathered from FSDP's shards).
        config: the model's configuration, which says whether the output projection is tied; needed only
            when `model` is a state dict.

    Raises:
        TypeError: `model` is a state dict and `config` is missing.
    """
    if isinstance(model, torch.nn.Module):
        state, config = model.state_dict(), model.config
    elif config is None:
        raise TypeError("model_state: pass the model's config with a state dict (it says what is tied).")
    else:
        state = model
    copies = _tied_copies(config)
    return {name: t.detach().contiguous().cpu() for name, t in state.items() if not name.endswith(copies)}


def check_loaded_names(missing: list[str], unexpected: list[str], config: VaswaniConfig) -> None:
    """Check what loading `model_state` weights left out: the tied copies of the embedding (§3.4) and nothing else.

    Args:
        missing, unexpected: the names `load_state_dict(..., strict=False)` reports (with or without
            the prefixes of a wrapper such as FSDP's).
        config: the model's configuration (whether its output projection is tied).

    Raises:
        CheckpointError: a weight of the model is missing or the file holds unknown weights.
    """
    copies = _tied_copies(config)
    untied = [n for n in missing if not n.endswith(copies)]
    if untied or unexpected:
        raise CheckpointError(f"the weights do not match the model: missing {untied}, unexpected {unexpected}.")


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load weights written by `model_state` (tied copies of the embedding left out) into `model`.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Raises:
        CheckpointError: a weight of the model is missing, the file holds unknown weights, or weights whose
            shapes are not the model's (its config.json is another model's).
    """
    try:
        loaded = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # shapes: the first lines of torch's message name the weights
        shapes = " ".join(line.strip() for line in str(error).splitlines()[1:3])
        raise CheckpointError(
            f"the weights do not fit the model its config.json describes ({shapes}); the config.json beside the "
            "checkpoints must be the one the run trained with."
        ) from None
    check_loaded_names(*loaded, model.config)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, path)
    give_umask_mode(path)  # safetensors writes through a temporary file of mode 0600


def _fsync(path: Path) -> None:
    # Data written but not synced can be lost on power failure even after the rename.
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def incomplete_dir(checkpoints_dir: Path, step: int, create: bool = True) -> Path:
    """Where every process writes its part of checkpoint `step` before `publish_checkpoint` renames it.

    Only one process should `create` it; the others take the path after a barrier.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """
    path = checkpoints_dir / f".incomplete-{_PREFIX}{step}"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def write_rng_state(directory: Path, rank: int) -> None:
    """Save this process's torch random number generators (CPU, and CUDA when present): dropout draws from them.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda-{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    _save_tensors(state, directory / f"rng-{rank}.safetensors")


def write_optimizer_partition(directory: Path, rank: int, state: dict) -> None:
    """Save this process's partition of a ZeRO optimizer (DeepSpeed) as `optimizer-<rank>.pt`.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        directory: from `incomplete_dir`; before the main process calls `write_main_state`.
        rank: the process's index.
        state: tensors, numbers, strings, lists and dicts only (read back with `weights_only=True`).
    """
    torch.save(state, directory / f"optimizer-{rank}.pt")


def write_main_state(
    directory: Path,
    model: torch.nn.Module | dict[str, torch.Tensor],
    optimizer_state: dict,
    trainer_state: dict,
    config: VaswaniConfig | None = None,
) -> None:
    """Write the weights, the optimizer/scheduler/scaler state and `trainer_state.json` (last, with file checksums).

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        directory: from `incomplete_dir`, after every process wrote its `rng-<rank>.safetensors` (and
            `optimizer-<rank>.pt`, under DeepSpeed).
        model: the unwrapped model, or the whole state dict of one (see `model_state`).
        optimizer_state: `{"optimizer": ..., "scheduler": ..., "scaler": ...}` state dicts (tensors,
            numbers, strings, lists and dicts only).
        trainer_state: JSON-serialisable progress (step, data position, log, ...).
        config: the model's configuration, when `model` is a state dict (see `model_state`).
    """
    _save_tensors(model_state(model, config), directory / WEIGHTS_NAME)
    torch.save(optimizer_state, directory / OPTIMIZER_NAME)
    files = sorted(p for p in directory.iterdir() if p.name != STATE_NAME)
    trainer_state = {**trainer_state, "files": {p.name: sha256_file(p) for p in files}}
    (directory / STATE_NAME).write_text(json.dumps(trainer_state, indent=1) + "\n")
    for path in directory.iterdir():
        _fsync(path)


def publish_checkpoint(directory: Path, keep: int, protect: tuple[int, ...] = ()) -> Path:
    """Rename a fully written checkpoint into place, then retire all but the last `keep` (and `protect`ed steps).

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        directory: the written checkpoint, `checkpoints/.incomplete-step-<N>`.
        keep: how many of the newest checkpoints stay, the published one among them; at least 1.
        protect: steps that stay whatever their age (the best by validation loss).

    Returns:
        The path of the published checkpoint, `checkpoints/step-<N>`.

    Raises:
        ValueError: `keep` is below 1 (nothing is renamed or removed then).
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint being published), got {keep}.")
    final = directory.parent / directory.name[len(".incomplete-") :]
    if final.exists():  # re-saving a step after a resume: the new copy replaces the old one
        retired = directory.parent / f".deleting-{final.name}"
        os.replace(final, retired)
        shutil.rmtree(retired)
    os.replace(directory, final)
    _fsync(directory.parent)
    for old in list_checkpoints(directory.parent)[:-keep]:
        if checkpoint_step(old) not in protect:
            retired = old.parent / f".deleting-{old.name}"
            os.replace(old, retired)
            shutil.rmtree(retired)
    return final


def _read_state(path: Path) -> dict:
    state_path = path / STATE_NAME
    try:
        state = json.loads(state_path.read_text())
        if not isinstance(state, dict) or not isinstance(state["files"], dict):
            raise ValueError("not a record of a checkpoint's files")
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{state_path} is missing or unreadable ({error}).") from error
    return state


def verify_checkpoint(path: Path, world_size: int | None) -> dict:
    """Check that a checkpoint is complete and undamaged before anything is loaded from it.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        path: a `step-<N>` directory.
        world_size: the number of processes that will resume from it (one RNG state each); None
            where only its weights are read (`average`), whatever number of processes wrote it.

    Returns:
        Its `trainer_state.json`.

    Raises:
        CheckpointError: a file is missing, its checksum differs from the recorded one, or the
            checkpoint was written by a different number of processes.
    """
    state = _read_state(path)
    files = state["files"]
    # Each process resumes its own random state and, under DeepSpeed, its own part of the optimizer.
    written_by = state.get("world_size", sum(name.startswith("rng-") for name in files))
    if world_size is not None and written_by != world_size:
        raise _ProcessCountError(
            f"{path} was written by {written_by} processes, not {world_size}: resume with the same number of "
            f"processes ({written_by})."
        )
    ranks = range(world_size) if world_size is not None else ()  # None: only the weights are read
    expected = {WEIGHTS_NAME, OPTIMIZER_NAME, *(f"rng-{rank}.safetensors" for rank in ranks)}
    if not expected <= files.keys():
        raise CheckpointError(f"{path} is incomplete: its record lacks {sorted(expected - files.keys())}.")
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing.")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{file} is damaged: its SHA-256 differs from the one recorded when it was written.")
    return state


def latest_good_checkpoint(checkpoints_dir: Path, world_size: int) -> tuple[Path | None, dict | None]:
    """The newest checkpoint, verified (see `verify_checkpoint`); (None, None) when there is none.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Raises:
        CheckpointError: the newest checkpoint is damaged (the message names the newest good one,
            so that the user can remove the damaged one and resume from there), or was written by
            another number of processes (the message says how many).
    """
    checkpoints = list_checkpoints(checkpoints_dir)
    if not checkpoints:
        return None, None
    try:
        return checkpoints[-1], verify_checkpoint(checkpoints[-1], world_size)
    except _ProcessCountError:
        raise
    except CheckpointError as error:
        good = None
        for older in reversed(checkpoints[:-1]):
            try:
                verify_checkpoint(older, world_size)
            except CheckpointError:
                continue
            good = older
            break
        advice = (
            f"The last good checkpoint is {good}: move {checkpoints[-1]} away and run again with --resume to continue "
            "from it."
            if good
            else "No older checkpoint is intact: start a new run in another --output-dir."
        )
        message = f"Cannot resume: checkpoint {checkpoints[-1].name} is damaged: {error} {advice}"
        raise CheckpointError(message) from error


def load_optimizer_state(path: Path, rank: int | None = None) -> dict:
    """Read `optimizer.pt` (or `optimizer-<rank>.pt`) without executing pickled code (`torch.load(weights_only=True)`).

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Raises:
        CheckpointError: the file holds anything but tensors and plain data, e.g. a crafted pickle.
    """
    file = path / (OPTIMIZER_NAME if rank is None else f"optimizer-{rank}.pt")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointError(
            f"{file} is not a safe optimizer state (only tensors and plain data are loaded, "
            f"never pickled code): {str(error).splitlines()[0]}"
        ) from error


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Read a checkpoint's `model.safetensors` (safetensors holds tensors only: nothing in it can run).

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Raises:
        CheckpointError: the file is not a valid safetensors file.
    """
    try:
        return load_file(path / WEIGHTS_NAME)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path / WEIGHTS_NAME} is not a valid safetensors file: {error}") from error


def restore_rng_state(path: Path, rank: int) -> None:
    """Restore this process's random number generators from `rng-<rank>.safetensors`.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """
    state = load_file(path / f"rng-{rank}.safetensors")
    torch.set_rng_state(state["cpu"])
    cuda = [state[f"cuda-{i}"] for i in range(torch.cuda.device_count()) if f"cuda-{i}" in state]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights of several checkpoints (§6.1, checkpoint averaging), in float32.

    "For the base models, we used a single model obtained by averaging the last 5 checkpoints,
    which were written at 10-minute intervals. For the big models, we averaged the last 20."

    Args:
        paths: checkpoint directories, or `.safetensors` weight files.

    Returns:
        `{name: tensor}` as `model_state` writes it.

    Raises:
        ValueError: `paths` is empty or the files do not hold the same tensors (names and shapes).
    """
    if not paths:
        raise ValueError("No checkpoints to average.")
    files = [p / WEIGHTS_NAME if p.is_dir() else p for p in map(Path, paths)]
    average = {k: v.double() for k, v in load_file(files[0]).items()}
    for file in files[1:]:
        state = load_file(file)
        if state.keys() != average.keys() or any(tensor.shape != average[n].shape for n, tensor in state.items()):
            raise ValueError(
                f"{file} does not hold the same tensors (names and shapes) as {files[0]}; cannot average them: "
                "average checkpoints of one run."
            )
        for name, tensor in state.items():
            average[name] += tensor.double()
    return {name: (total / len(files)).float() for name, total in average.items()}


def record_averaged_steps(model_dir: str | Path, checkpoints: list[Path]) -> None:
    """Record in `model_dir`'s `training_config.json` the steps of the checkpoints its weights average (§6.1).

    The model card's recipe names them (`model_card.write_model_card`): `average --last M`, and a run that wrote fewer
    checkpoints than its `average_last`, average others than the run's settings say. Nothing is written where
    the directory holds no readable record of a run (a model saved elsewhere).

    Args:
        model_dir: a model directory written by `train` or `average`.
        checkpoints: the averaged checkpoints (`step-<N>` directories), oldest first.
    """
    record = Path(model_dir) / "training_config.json"
    try:
        settings = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    if isinstance(settings, dict):
        settings["averaged_steps"] = [checkpoint_step(path) for path in checkpoints]
        write_text_atomically(record, json.dumps(settings, indent=2) + "\n")


def average_run_checkpoints(run_dir: str | Path, last: int, output_dir: str | Path | None = None) -> Path:
    """`vaswani-transformer average`: a loadable model whose weights are the mean of a run's last checkpoints (§6.1).

    "For the base models, we used a single model obtained by averaging the last 5 checkpoints [...]
    For the big models, we averaged the last 20 checkpoints."

    Args:
        run_dir: the output directory of a training run (its config, tokenizer and `checkpoints/`).
        last: how many of the newest checkpoints to average.
        output_dir: where to write the model; default: `run_dir`, replacing its model. The run's
            generation_config.json (the decoding chosen on its validation set) is kept; its model
            card's scores, measured on the weights replaced, are dropped. Another directory gets the
            run's training_config.json too (its languages, which `serve` reads) and a model card.

    Returns:
        The directory written, loadable with `from_pretrained`.

    Raises:
        ValueError: `last` is not positive, the run has fewer than `last` checkpoints (says how many),
            it holds no config.json, or `output_dir` (other than `run_dir`) already holds a run or a model.
        CheckpointError: one of them is damaged.
        OSError: `output_dir` cannot be written (a file, say), found before the model is built.
    """
    run_dir = Path(run_dir)
    available = list_checkpoints(run_dir / "checkpoints")
    if last <= 0 or last > len(available):
        raise ValueError(
            f"Cannot average the last {last} checkpoints: {run_dir / 'checkpoints'} holds {len(available)}."
        )
    chosen = available[-last:]
    for path in chosen:
        verify_checkpoint(path, world_size=None)
    if not (run_dir / "config.json").is_file():
        raise ValueError(
            f"{run_dir} holds no config.json: runs write it when they start, earlier versions when they end; "
            "copy the config.json of a model trained with the same settings into it."
        )
    if output_dir is not None and Path(output_dir).resolve() != run_dir.resolve():
        held = [name for name in ("checkpoints", "config.json", "model.safetensors", "tokenizer.json")
                if (Path(output_dir) / name).exists()]  # fmt: skip
        if held:  # another run's or model's: averaging there would overwrite it
            raise ValueError(
                f"{output_dir} already holds {', '.join(held)}: the averaged model would overwrite them. "
                "Give a new or empty --output-dir, or leave it out to average into the run's directory."
            )
    ensure_writable(output_dir or run_dir)  # transformers only logs a save to a file's path, and writes nothing
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    model = VaswaniForConditionalGeneration(VaswaniConfig.from_pretrained(run_dir))
    if (run_dir / GENERATION_CONFIG_NAME).is_file():  # the decoding the run chose on its validation set (§6.1)
        model.generation_config = GenerationConfig.from_pretrained(run_dir)
    load_model_state(model, average_checkpoints(chosen))
    written = save_translator(model, tokenizer, output_dir or run_dir)
    if written.resolve() != run_dir.resolve() and (run_dir / "training_config.json").is_file():
        shutil.copy2(run_dir / "training_config.json", written / "training_config.json")  # the run's languages
    record_averaged_steps(written, chosen)
    if (written / "README.md").is_file() or written.resolve() != run_dir.resolve():
        write_model_card(written, keep_results=False)  # scores measured on the weights replaced go
    return written
