"""The end of a `train` run: the last checkpoints averaged (§6.1), its decoding chosen, the translator saved."""

import json
import logging
from dataclasses import asdict
from pathlib import Path

from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from ..exchange.model_card import write_model_card
from ..exchange.saving import save_translator
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from ..utils.files import room_for
from ..utils.plotting import plot_learning_curve
from . import checkpoints as ckpt
from .checkpointer import WholeModel, weight_bytes
from .config import TrainingConfig
from .directory import read_record
from .validation import ValidationSplit

logger = logging.getLogger(__name__)


class Finisher:
    """How a run ends: its averaged model, with the decoding chosen on the development set, saved.

    Args:
        config: the run's settings (`average_last`, `choose_num_beams`, `choose_length_penalty`).
        accelerator: the run's processes; the main process averages and saves.
        whole: the run's model, whole however it is sharded: the averaged weights go into `whole.module()`.
        tokenizer: the run's tokenizer, saved with the model.
        split: the validation split to choose the decoding on; None without one.
        output_dir: the run's output directory, where the model goes.
        checkpoints_dir: the run's checkpoints, whose last ones are averaged.
        log_path: the run's `training_log.jsonl`, for the learning curve and the model card.
    """

    def __init__(
        self,
        config: TrainingConfig,
        accelerator: Accelerator,
        whole: WholeModel,
        tokenizer: PreTrainedTokenizerBase,
        split: ValidationSplit | None,
        output_dir: Path,
        checkpoints_dir: Path,
        log_path: Path,
    ) -> None:
        self.config, self.accelerator, self.whole = config, accelerator, whole
        self.tokenizer, self.split = tokenizer, split
        self.output_dir, self.checkpoints_dir, self.log_path = output_dir, checkpoints_dir, log_path

    def finish(self) -> Path:
        """Average the last `average_last` checkpoints into the model (§6.1), choose its decoding on the validation
        set when asked (`choose_num_beams`, `choose_length_penalty`), and save it with its card and curve.

        Returns:
            The output directory, loadable with `from_pretrained`.

        Raises:
            ValueError: no checkpoint is left to average, or their tensors differ.
            OSError: the disk has no room for the model (the message says how much it needs; a resumed run that
                has ended only finishes).
        """
        accelerator = self.accelerator
        if accelerator.is_main_process:
            last = ckpt.list_checkpoints(self.checkpoints_dir)[-self.config.average_last :]
            model = self.whole.module()
            ckpt.load_model_state(model, ckpt.average_checkpoints(last))
            self._choose_decoding(model)  # may rewrite training_config.json: the averaged steps go in after
            resume = "run the same command with --resume: it only saves the model"
            with room_for(self.output_dir, weight_bytes(model), "the model", resume):
                save_translator(model, self.tokenizer, self.output_dir)
                ckpt.record_averaged_steps(self.output_dir, last)
                write_model_card(self.output_dir, keep_results=False)  # scores of earlier weights (resumed) go
                try:
                    plot_learning_curve(self.log_path, self.output_dir / "learning_curve.png")
                except (ImportError, ValueError) as error:  # matplotlib is optional; a run with no log has no curve
                    accelerator.print(f"No learning_curve.png: {error}")
        accelerator.wait_for_everyone()
        accelerator.end_training()  # closes the trackers and the process group
        return self.output_dir

    def _choose_decoding(self, model: VaswaniForConditionalGeneration) -> None:
        # §6.1's beam size and length penalty, chosen on the development set: the best pair becomes the model's
        # generation config, and every pair tried is recorded in training_config.json.
        config, generation = self.config, model.generation_config
        if not (config.choose_num_beams or config.choose_length_penalty):
            return
        if self.split is None:
            logger.warning("No validation split: the decoding stays the paper's (`paper_generation_config`, §6.1).")
            return
        from ..inference.translation import choose_decoding

        model.eval()
        choice = choose_decoding(
            model,
            self.tokenizer,
            self.split.sources,
            self.split.references,
            config.choose_num_beams or [generation.num_beams],
            config.choose_length_penalty or [float(generation.length_penalty)],
        )
        generation.num_beams = choice["num_beams"]
        if choice["length_penalty"] is None:  # greedy: transformers refuses to save beam-search settings with it
            generation.length_penalty, generation.early_stopping = 1.0, False
        else:
            generation.length_penalty = choice["length_penalty"]
        self.accelerator.print(json.dumps({"decoding_choice": choice}))
        saved = read_record(self.output_dir) or asdict(config)  # deleted or damaged during the run: rewritten
        ckpt.write_text_atomically(
            self.output_dir / "training_config.json", json.dumps({**saved, "decoding_choice": choice}, indent=2) + "\n"
        )
