"""Validation during a `train` run: the label-smoothed loss (§5.4) and BLEU (§6.1), the best step, early stopping."""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from .checkpointer import WholeModel
from .config import TrainingConfig
from .devices import broadcast_from_main
from .state import RunState


@torch.no_grad()
def validation_loss(model: VaswaniForConditionalGeneration, batches: Iterable[dict], accelerator: Accelerator) -> float:
    """Label-smoothed loss per target token over the validation batches of every process, dropout off (§5.4).

    Args:
        model: the unwrapped model (no data-parallel wrapper, whose forward would synchronise), or under
            FSDP the wrapped one, whose forward gathers the sharded parameters: every process must then run
            as many batches (`TokenBatchSampler` deals them so).
        batches: this process's validation batches: `input_ids`, `attention_mask` and `labels` of shape
            (sentences, tokens), `labels` -100 on padding.
        accelerator: for the device and the sum over processes (every process must call this).

    Returns:
        The loss in nats per target token (0.0 when there are no target tokens). The model is left in
        training mode.
    """
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # summed loss, target tokens
    for batch in batches:
        batch = batch.to(accelerator.device)
        tokens = batch["labels"].ne(-100).sum()
        total += torch.stack([model(**batch, num_items_in_batch=1).loss.double(), tokens.double()])
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1].clamp(min=1))


@dataclass(frozen=True)
class ValidationSplit:
    """A run's validation split (the development set of §6): its batches and its sentences.

    Attributes:
        batches: this process's validation batches (`batches.run_batches`), for the loss.
        sources, references: the split's sentences in the source and target language, in order, for BLEU
            and for choosing the decoding (`finish`).
    """

    batches: Iterable[dict]
    sources: list[str]
    references: list[str]


class Validator:
    """A run's validations: their scores, the best step so far in the run's state, and when patience runs out.

    Args:
        config: the run's settings (`bleu_sentences`, `early_stopping_patience`).
        accelerator: the run's processes; every one validates, the main one translates for BLEU.
        whole: the run's model, whole however it is sharded.
        tokenizer: the run's tokenizer, to translate with.
        split: the validation split.
        state: the run's progress, whose `best_score`, `best_step` and `validations_without_improvement` it updates
            (`RunState.count_validation`).
    """

    def __init__(
        self,
        config: TrainingConfig,
        accelerator: Accelerator,
        whole: WholeModel,
        tokenizer: PreTrainedTokenizerBase,
        split: ValidationSplit,
        state: RunState,
    ) -> None:
        self.config, self.accelerator, self.whole = config, accelerator, whole
        self.tokenizer, self.split, self.state = tokenizer, split, state

    def validate(self, record: dict) -> tuple[bool, bool]:
        """Validation loss (and BLEU, §6.1) into `record`; whether it is the best so far, whether patience ran out.

        Args:
            record: the step's log record (with its `step`); gains `validation_loss` (nats per target token)
                and, with `bleu_sentences`, `validation_bleu` (0 to 100, the same on every process).

        Returns:
            (improved, patience_over): a better BLEU (or loss, without BLEU) than any before, and whether
            `early_stopping_patience` validations in a row have not improved.
        """
        accelerator, state, whole = self.accelerator, self.state, self.whole
        record["validation_loss"] = score = validation_loss(whole.forward_module(), self.split.batches, accelerator)
        if self.config.bleu_sentences:
            bleu = 0.0
            weights = whole.weights() if whole.sharded else None  # every process takes part in gathering
            if accelerator.is_main_process:
                n = self.config.bleu_sentences
                sources, references = self.split.sources[:n], self.split.references[:n]
                from ..inference.translation import validation_bleu

                bleu = validation_bleu(whole.module(weights), self.tokenizer, sources, references)
            record["validation_bleu"] = bleu = float(
                broadcast_from_main(accelerator, torch.tensor([bleu], dtype=torch.float64))[0]
            )
            score = -bleu
        improved = state.count_validation(score)  # the best model is kept as a checkpoint, whatever --save-steps says
        patience = self.config.early_stopping_patience
        patience_over = patience is not None and state.validations_without_improvement >= patience
        if patience_over:
            accelerator.print(f"Early stopping at step {record['step']}: no improvement in {patience} validations.")
        return improved, patience_over
