"""Validation during a `train` run: the label-smoothed loss (§5.4) and BLEU (§6.1), the best step, early stopping."""

from collections.abc import Iterable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import PreTrainedTokenizerBase

from .modeling_vaswani import VaswaniForConditionalGeneration
from .training_config import TrainingConfig
from .training_devices import broadcast_from_main


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


class RunValidation:
    """A `TrainingRun`'s validations: their scores, the best step so far, and when patience runs out.

    A part of `training.TrainingRun`, which sets what it reads: the run's `config`, `accelerator`, `model` (as
    Accelerate prepared it) and `unwrapped`, `tokenizer`, `valid_batches`, `validation_sources` and
    `validation_references` (the validation split's sentences), and `state`, whose `best_score`, `best_step`
    and `validations_without_improvement` it updates. It translates with the whole model of
    `training_checkpoints.RunCheckpoints` (`_whole_model`, `_whole_weights`).
    """

    config: TrainingConfig
    accelerator: Accelerator
    model: torch.nn.Module
    unwrapped: VaswaniForConditionalGeneration
    tokenizer: PreTrainedTokenizerBase
    valid_batches: Iterable[dict]
    validation_sources: list[str]
    validation_references: list[str]
    state: dict

    def validate(self, record: dict) -> tuple[bool, bool]:
        """Validation loss (and BLEU, §6.1) into `record`; whether it is the best so far, whether patience ran out.

        Args:
            record: the step's log record (with its `step`); gains `validation_loss` (nats per target token)
                and, with `bleu_sentences`, `validation_bleu` (0 to 100, the same on every process).

        Returns:
            (improved, patience_over): a better BLEU (or loss, without BLEU) than any before, and whether
            `early_stopping_patience` validations in a row have not improved.
        """
        accelerator, state = self.accelerator, self.state
        # FSDP's forward gathers the sharded parameters: every process runs the wrapped model, on as many batches.
        model = self.model if accelerator.distributed_type == DistributedType.FSDP else self.unwrapped
        record["validation_loss"] = score = validation_loss(model, self.valid_batches, accelerator)
        if self.config.bleu_sentences:
            bleu = 0.0
            weights = self._whole_weights() if self._sharded() else None  # every process takes part in gathering
            if accelerator.is_main_process:
                n = self.config.bleu_sentences
                sources, references = self.validation_sources[:n], self.validation_references[:n]
                from .translation import validation_bleu

                bleu = validation_bleu(self._whole_model(weights), self.tokenizer, sources, references)
            record["validation_bleu"] = bleu = float(
                broadcast_from_main(accelerator, torch.tensor([bleu], dtype=torch.float64))[0]
            )
            score = -bleu
        improved = state["best_score"] is None or score < state["best_score"]
        if improved:  # the best model is kept as a checkpoint, whatever --save-steps says
            state.update(best_score=score, best_step=record["step"], validations_without_improvement=0)
        else:
            state["validations_without_improvement"] += 1
        patience = self.config.early_stopping_patience
        patience_over = patience is not None and state["validations_without_improvement"] >= patience
        if patience_over:
            accelerator.print(f"Early stopping at step {record['step']}: no improvement in {patience} validations.")
        return improved, patience_over
