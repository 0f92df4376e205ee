"""`vaswani-transformer ablate`: the rows of Table 3 (§6.2) trained with one recipe and budget, scored alike.

Every run is one `train` run (`training.run.train`) of a row and a seed, in `OUTPUT_DIR/<row>-seed<k>/`, on the one
corpus and tokenizer, prepared once into the data cache. Each run trains with no checkpoint averaging (Table 3
has none) and is scored on the validation split (the paper's development set, newstest2013):

- parameters, counted once where the embeddings are shared (§3.4);
- perplexity per target token, exp of the cross entropy without label smoothing (`validation.validation_loss`);
- sacreBLEU of the paper's beam search (beam 4, length penalty 0.6, at most input length + 50 tokens, §6.1) on the
  first `bleu_sentences` sentences: the run's last validation (`validation.Validator`), on its final weights;
- the optimizer steps and the minutes of training (`training_log.jsonl`).

A run's `result.json` marks it done: a later call skips it, and resumes a run that was stopped from its last
checkpoint. Runs go to `processes` worker processes (spawned, `threads` threads each); on a GPU they share it.
After every run the report (`report.write_report`) is written anew from every `result.json` there is, so that a
call with more seeds or rows adds to the table.
"""

import json
import math
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..data.corpora import corpus_fingerprint
from ..inference.config import cpu_threads, torch_threads
from ..inference.engines import load_translator
from ..model.configuration_vaswani import VaswaniConfig
from ..training.batches import run_tokenizer, token_batches
from ..training.config import RUN_FIELDS, TrainingConfig
from ..training.corpus import prepare_corpus
from ..training.devices import start_accelerator
from ..training.run import NonFiniteLossError, train, validation_loss
from ..utils.files import ensure_writable, read_log, write_text_atomically
from ..utils.options import option
from ..utils.plotting import pyplot
from .report import write_report
from .table3 import BASE, GROUPS, Row, select_rows, table3_rows

# What makes the runs of one ablation comparable: the recipe every row trains with. A later call into the same
# directory must give the same, or its rows would be read against rows trained otherwise.
RECIPE_FIELDS = tuple(name for name in RUN_FIELDS if name != "seed") + (
    "max_steps", "max_minutes", "eval_steps", "early_stopping_patience", "skip_nonfinite", "tokenizer", "vocab_size",
    "tokenizer_sample",
)  # fmt: skip
# The `train` settings every run has whatever the call gives (`run_config`): no `ablate` option sets them.
RUN_SETTINGS = dict(
    resume=True, average_last=1, keep_checkpoints=1, choose_num_beams=[], choose_length_penalty=[], prepare_only=False
)
RECORD = "ablation.json"


@dataclass
class AblationConfig:
    """An ablation: the recipe every row trains with (`training`), the rows, the seeds and the processes.

    `training.output_dir` is the ablation's directory, `training.seed` the first seed, and `training.preset` with
    `training.model_overrides` the base model the rows are scaled to (`table3.table3_rows`).

    Raises:
        ValueError: a count that is not positive, `base_seeds` below `seeds`, no `bleu_sentences` to score BLEU on,
            or `curves` no group of rows.
    """

    training: TrainingConfig
    rows: str = option(
        "all",
        help="rows of Table 3 to run, comma-separated: names (base, A1, ..., E, U1), group letters (A) or all; "
        "the base row always runs",
        group="ablation",
    )
    seeds: int = option(1, help="runs of every row, seeded --seed, --seed + 1, ...", group="ablation")
    base_seeds: int = option(
        2,
        help="runs of the base row (at least --seeds): the seed spread every difference is read against",
        group="ablation",
    )
    processes: int = option(
        1,
        help="worker processes that train runs side by side (spawned; on a GPU they share it), --threads each "
        "(by default the cores less one, divided among them)",
        group="ablation",
    )
    curves: str = option(
        "A",
        help="the row group whose learning curves are drawn with the base row's (A, B, C, D, E, U)",
        group="ablation",
    )

    def __post_init__(self) -> None:
        for name in ("seeds", "base_seeds", "processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.base_seeds < self.seeds:
            raise ValueError(f"--base-seeds ({self.base_seeds}) must be at least --seeds ({self.seeds}).")
        if not self.training.bleu_sentences:
            raise ValueError(
                "ablate scores every row by validation BLEU: give --bleu-sentences N (the first N validation "
                "sentences; e.g. 1014, all of Multi30k's)."
            )
        if self.curves not in GROUPS[1:]:
            raise ValueError(f"--curves must be a group of rows, one of {', '.join(GROUPS[1:])}; got {self.curves!r}.")


def run_config(ablation: AblationConfig, row: Row, seed: int) -> TrainingConfig:
    """The `train` settings of one run: the recipe, the row's model, the seed, its own directory, no averaging.

    Args:
        ablation: the ablation.
        row: the row (its overrides go on top of the recipe's `model_overrides`).
        seed: the run's seed.

    Returns:
        The run's config: `OUTPUT_DIR/<row>-seed<seed>`, resumed where a checkpoint is, the last checkpoint
        as the model (Table 3 averages none), `threads` the recipe's or the cores' share of one of `processes`.
    """
    recipe = ablation.training
    return replace(
        recipe,
        threads=cpu_threads(recipe.threads, processes=ablation.processes),
        output_dir=str(Path(recipe.output_dir) / f"{row.name}-seed{seed}"),
        seed=seed,
        model_overrides={**recipe.model_overrides, **row.overrides},
        **RUN_SETTINGS,
    )


def planned_runs(ablation: AblationConfig) -> list[tuple[Row, int]]:
    """Every (row, seed) the ablation asks for, first seeds first: a stopped call leaves whole rows, not seeds.

    Args:
        ablation: the ablation.

    Returns:
        `(row, seed)` pairs: `seeds` of every row and `base_seeds` of the base row, seeds from `training.seed` up.

    Raises:
        ValueError: `rows` names no row here (`table3.select_rows`), or the base model is impossible.
    """
    recipe = ablation.training
    base = VaswaniConfig.from_preset(recipe.preset, **recipe.model_overrides)
    rows = select_rows(table3_rows(base), ablation.rows)
    runs = []
    for index in range(ablation.base_seeds):
        for row in rows:
            if index < (ablation.base_seeds if row.name == BASE else ablation.seeds):
                runs.append((row, recipe.seed + index))
    return runs


def score_run(config: TrainingConfig, row: Row, wall_seconds: float | None) -> dict:
    """Score a finished run as the module docstring says, and write its `result.json`.

    Args:
        config: the run's settings (`run_config`).
        row: its row.
        wall_seconds: how long `train` took, corpus opening and saving included; None where unknown.

    Returns:
        The result, as written.

    Raises:
        ValueError: the run's log holds no validation BLEU (no validation split).
    """
    output_dir = Path(config.output_dir)
    records = read_log(output_dir / "training_log.jsonl")
    validations = [record for record in records if "validation_bleu" in record]
    if not validations:
        raise ValueError(f"{output_dir} logged no validation BLEU: ablate needs a validation split (val.<lang>).")
    model, _ = load_translator(str(output_dir))  # the corpus its recipe pins holds the tokenizer (RECIPE_FIELDS)
    accelerator = start_accelerator(replace(config, mixed_precision="no", report_to=[]), launched_on_cpus=False)
    files = corpus_fingerprint(config.data, config.source_lang, config.target_lang, config.files)
    corpus = prepare_corpus(config, run_tokenizer(config, resuming=False), files)  # the prepared one, opened
    batches = token_batches(corpus.validation, corpus.tokenizer, config.max_tokens, False, 0, accelerator)
    settings = {name: getattr(model.config, name) for name in MODEL_COLUMNS}
    model.config.label_smoothing = 0.0  # the perplexity of the model's distribution, not of the smoothed target
    cross_entropy = validation_loss(model, batches, accelerator)
    result = {
        "row": row.name,
        "group": row.group,
        "seed": config.seed,
        "overrides": row.overrides,
        "model": settings,
        "key_dim": model.config.key_dim,
        "value_dim": model.config.value_dim,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "steps": records[-1]["step"],
        "train_minutes": records[-1]["minutes"],
        "wall_seconds": wall_seconds,
        "validation_cross_entropy": cross_entropy,
        "validation_perplexity": math.exp(cross_entropy),
        "validation_bleu": validations[-1]["validation_bleu"],
        "bleu_sentences": min(config.bleu_sentences, len(corpus.validation)),
        "diverged": None,
    }
    write_text_atomically(output_dir / "result.json", json.dumps(result, indent=2) + "\n")
    return result


# The model's settings a result records, for the table's columns (report.COLUMNS).
MODEL_COLUMNS = (
    "encoder_layers", "d_model", "d_ff", "num_attention_heads", "dropout", "label_smoothing",
    "position_embedding_type",
)  # fmt: skip


def run_row(config: TrainingConfig, row: Row) -> dict:
    """Train one run (`training.run.train`), or go on with it, then score it (`score_run`).

    A run whose loss becomes NaN or infinite is a result too (rows U may diverge): its `result.json` says so, with
    no scores.

    Args:
        config: the run's settings (`run_config`).
        row: its row.

    Returns:
        The run's result.

    Raises:
        As `train` raises, but `NonFiniteLossError`.
    """
    started = time.monotonic()
    with torch_threads(config.cpu_threads()):  # scoring too, not only `train`, keeps to the run's share of cores
        try:
            train(config)
        except NonFiniteLossError as error:
            output_dir = Path(config.output_dir)
            result = {"row": row.name, "group": row.group, "seed": config.seed, "overrides": row.overrides,
                      "diverged": str(error), "wall_seconds": time.monotonic() - started}  # fmt: skip
            write_text_atomically(output_dir / "result.json", json.dumps(result, indent=2) + "\n")
            return result
        return score_run(config, row, time.monotonic() - started)


def _start_worker() -> None:
    # A worker's initializer. Ctrl-C reaches every process of the terminal's group: the parent alone handles it, and
    # stops the workers (`run_ablation`). Killed (SIGTERM, SIGKILL, out of memory), the parent stops nothing, and each
    # worker would train on into the output directory, an orphan: the parent's sentinel is ready when it ends,
    # however it ends, and the worker then stops as `terminate` would have stopped it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()

    def watch() -> None:
        parent.join()
        signal.raise_signal(signal.SIGTERM)

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


def _run_on_workers(
    pending: list[tuple[TrainingConfig, Row]], processes: int, finished: Callable[[dict], None]
) -> None:
    # spawn: a fork would copy this process's torch threads and state. A failed, stopped or interrupted call stops
    # every run at once; each resumes from its last checkpoint at the next call.
    before = set(multiprocessing.active_children())
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, spawn, _start_worker, max_tasks_per_child=1) as pool:
        try:
            for future in as_completed([pool.submit(run_row, config, row) for config, row in pending]):
                finished(future.result())
        except BrokenProcessPool as error:
            raise BrokenProcessPool(
                "A worker process ended without its run's result (killed, or out of memory?): run the same command "
                "again to go on (finished runs are skipped, a stopped one resumes from its last checkpoint); give "
                "fewer --processes where memory is short."
            ) from error
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in set(multiprocessing.active_children()) - before:
                worker.terminate()
            raise


def _check_recipe(ablation: AblationConfig) -> None:
    # The first call records the recipe; a later one must give the same, else its rows are not comparable.
    recipe = {name: getattr(ablation.training, name) for name in RECIPE_FIELDS}
    recipe = json.loads(json.dumps(recipe))
    path = Path(ablation.training.output_dir) / RECORD
    if path.exists():
        recorded = json.loads(path.read_text())["recipe"]
        changed = [f"{name} was {recorded[name]!r}, now {recipe[name]!r}" for name in recipe
                   if name in recorded and recorded[name] != recipe[name]]  # fmt: skip
        if changed:
            raise ValueError(
                f"{path.parent} holds an ablation of another recipe ({'; '.join(changed)}): give its settings "
                "again, or another --output-dir."
            )
    else:
        write_text_atomically(path, json.dumps({"recipe": recipe, "training": asdict(ablation.training)}, indent=2))


def run_ablation(ablation: AblationConfig, report: Callable[[str], None] = print) -> Path:
    """Run every row and seed the ablation asks for that is not done yet, and write the report (`report`).

    Args:
        ablation: the ablation.
        report: called with one line as each run is skipped, starts or ends.

    Returns:
        The report's Markdown table, `OUTPUT_DIR/table3.md` (beside it `table3.json` and the plots).

    Raises:
        ValueError: an unknown row, a recipe other than the one the directory's runs trained with, a corpus
            without a validation split; or as `train` raises.
        OSError: the output directory cannot be written; or as `train` raises.
        ImportError: matplotlib is missing (the `plot` extra), before any training.
        BrokenProcessPool: with `processes` above 1, a worker process ended without its run's result.
    """
    pyplot()
    recipe = ablation.training
    runs = planned_runs(ablation)
    output_dir = ensure_writable(recipe.output_dir)
    _check_recipe(ablation)
    prepared = train(replace(recipe, prepare_only=True))  # the one corpus and tokenizer of every run
    if not (Path(prepared) / "validation.arrow").exists():
        raise ValueError("ablate scores on the validation split: give a corpus with val.<lang> files.")
    pending = []
    for row, seed in runs:
        config = run_config(ablation, row, seed)
        if (Path(config.output_dir) / "result.json").exists():
            report(f"{row.name} seed {seed}: done before, skipped")
        else:
            pending.append((config, row))

    def finished(result: dict) -> None:
        scores = "diverged" if result["diverged"] else (
            f"BLEU {result['validation_bleu']:.2f}, perplexity {result['validation_perplexity']:.2f}, "
            f"{result['steps']} steps in {result['train_minutes']:.1f} min"
        )  # fmt: skip
        report(f"{result['row']} seed {result['seed']}: {scores}")
        write_report(output_dir, ablation.curves)

    if ablation.processes == 1:  # in this process: no second start of torch
        for config, row in pending:
            report(f"{row.name} seed {config.seed}: training")
            finished(run_row(config, row))
    elif pending:
        report(f"{len(pending)} runs on {ablation.processes} processes of {pending[0][0].threads} threads each")
        _run_on_workers(pending, ablation.processes, finished)
    return write_report(output_dir, ablation.curves)
