"""The files of a run and of a model, written so that no crash, full disk or other reader sees half of one.

Every module that writes outputs takes these from here: a directory proved writable before any work
(`ensure_writable`), text replaced whole (`write_text_atomically`), room checked before large writes
(`room_for`), the mode a new file gets (`give_umask_mode`), and the run's log read back as far as it is
whole (`read_log`). It imports nothing of the package, so that any layer may use it.
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# The file by which a `train` run holds its output directory against other runs (training.py); no part of the model.
TRAINING_LOCK_NAME = ".train.lock"


def give_umask_mode(*paths: str | Path) -> None:
    """Give files the mode that `open()` gives a new file: read and write for all, less the process's umask.

    safetensors (0.8) writes through a temporary file of mode 0600 that it renames into place, so that
    its weights would be the one file of a model that those who may read the others cannot.

    Args:
        paths: files this process owns.
    """
    umask = os.umask(0o077)  # reading the umask means setting it: meanwhile, new files are private, never open
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


def ensure_writable(path: str | Path, is_file: bool = False) -> Path:
    """Check that `path` can be written before any work is done, creating the directory if needed.

    A directory is proved writable by creating and removing a file in it, which also catches
    read-only file systems and paths that lead through a file; a file needs a writable directory
    and must not be a directory or an existing file that cannot be written.

    See docs/robustness.md, "Bad input".

    Args:
        path: an output directory (`train --output-dir`), or with `is_file`, an output file
            (`evaluate --output`), whose directory is created.
        is_file: whether `path` names a file.

    Returns:
        `path` as a `Path`.

    Raises:
        OSError: `path` cannot be written; the message names it and the reason.
    """
    path = Path(path)
    directory = path.parent if is_file else path
    try:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
        if is_file and path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if is_file and path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as error:
        message = f"Cannot write to {path}: {error.strerror or error}; choose another path or fix the permissions."
        raise OSError(message) from error
    return path


def read_log(log: Path) -> list[dict]:
    """The records of a run's `training_log.jsonl`, up to the first that is not whole JSON.

    A run killed while appending a record leaves half a line; it, and anything after it, is left
    out with one warning, so that the run resumes (its checkpoint comes before that record).

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        log: a run's `training_log.jsonl`, one JSON record per line (step, losses, minutes, ...).

    Returns:
        The records, in order, as dicts.

    Raises:
        OSError: the file cannot be read.
    """
    records = []
    for number, line in enumerate(Path(log).read_text(encoding="utf-8").splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s, line %d: not a whole record (a run killed while writing it); it and any after it "
                           "are left out.", log, number)  # fmt: skip
            break
    return records


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, as 64 hexadecimal digits, read in blocks of 1 MiB.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def room_for(directory: Path, needed: int, what: str, then: str) -> Iterator[None]:
    """Around writes of `what`, about `needed` bytes, into `directory`: where the disk cannot hold them, one line.

    The free space is checked before anything is written, and a write that fails for want of space
    becomes the same error: safetensors, torch and tokenizers report it in errors of their own, the
    last two with no errno.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        directory: an existing directory of the file system written to.
        needed: the bytes the writes take.
        what: what is written, for the message (e.g. "checkpoint step-500").
        then: what to do once there is room (e.g. "run the same command with --resume").

    Raises:
        OSError: the file system holds less than `needed` bytes free, or a write failed for want of
            space; the message names `directory`, the space needed and the space free.
    """
    directory = Path(directory)

    def no_room() -> OSError:
        free = shutil.disk_usage(directory).free
        return OSError(
            f"No space left in {directory} for {what}: it needs about {needed / 1e6:,.1f} MB free, and "
            f"{free / 1e6:,.1f} MB are. Free some space, then {then}."
        )

    if shutil.disk_usage(directory).free < needed:
        raise no_room()
    try:
        yield
    except Exception as error:
        if isinstance(error, OSError):
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        else:  # a writer's own error; torch's names no reason, but the disk it left full does
            full = os.strerror(errno.ENOSPC) in str(error) or shutil.disk_usage(directory).free < needed
        if not full:
            raise
        raise no_room() from error


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a file beside it renamed into place.

    A crash at any moment leaves the old file or the new one, whole (a rename is atomic on POSIX file systems).
    See docs/training.md, "Training at scale, and runs that survive being killed".
    """
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
