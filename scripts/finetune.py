"""Fine-tune a saved translator on another parallel corpus with transformers' `Seq2SeqTrainer`.

    python scripts/finetune.py --model outputs/multi30k-en-de --data-dir my_corpus/ \
        --source-lang en --target-lang de --output-dir outputs/finetuned --max-steps 2000

The corpus is read like `vaswani-transformer train` reads it (a directory of `train.<lang>` and
`val.<lang>` files, or `--dataset` for a Hub dataset). The Trainer batches with
`DataCollatorForSeq2Seq`, evaluates sacreBLEU on the validation split with `generate()` (the
model's generation config: the paper's beam search), and saves the best model by BLEU. The
model's loss takes the Trainer's `num_items_in_batch`, so under gradient accumulation every
target token of the optimizer step counts the same, as in one bigger batch.
"""

import argparse
import copy

from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    EvalPrediction,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

import vaswani_transformer  # noqa: F401  (registers the Auto classes)
from vaswani_transformer.data.corpora import corpus_location, load_parallel_corpus
from vaswani_transformer.exchange.saving import save_translator
from vaswani_transformer.inference.translation import corpus_bleu
from vaswani_transformer.training.config import TrainingConfig
from vaswani_transformer.training.devices import avoid_cudnn_attention


class _Seq2SeqTrainer(Seq2SeqTrainer):
    """`Seq2SeqTrainer` that leaves the model's generation config as it found it.

    After each evaluation batch, `Seq2SeqTrainer.prediction_step` fills the model's generation config
    with transformers' defaults (`max_length=20`, `top_k=50`, ...): every later `generate()` would
    warn that both `max_new_tokens` (the model's limit of source length + 50, §6.1) and `max_length`
    are set, and the fine-tuned model would be saved with them.
    """

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        kept = copy.deepcopy(self.model.generation_config)
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)
        finally:
            self.model.generation_config = kept


def build_trainer(
    model_dir: str,
    data: str,
    source_lang: str,
    target_lang: str,
    output_dir: str,
    max_length: int = TrainingConfig.max_length,
    config_overrides: dict | None = None,
    **training_arguments,
) -> Seq2SeqTrainer:
    """A `Seq2SeqTrainer` that fine-tunes `model_dir` on the corpus `data` and scores sacreBLEU.

    Args:
        model_dir: a saved translator (directory or Hub id) with its tokenizer.
        data: corpus directory or Hub dataset id (see `vaswani_transformer.data.corpora.load_parallel_corpus`);
            it needs a "train" split and, for evaluation, a "validation" split.
        source_lang, target_lang: language codes (file extensions or dataset columns).
        output_dir: the Trainer's output directory.
        max_length: longer sentences are truncated to this many tokens.
        config_overrides: `VaswaniConfig` fields to change for fine-tuning, e.g. `{"dropout": 0.3}`.
        **training_arguments: any `Seq2SeqTrainingArguments` field (`max_steps`, `learning_rate`,
            `per_device_train_batch_size`, `gradient_accumulation_steps`, ...).

    Returns:
        The trainer; call `.train()` and `.evaluate()`.

    Raises:
        ValueError: the corpus has no "train" split (from `load_parallel_corpus`), or a field of
            `training_arguments` is invalid.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, **(config_overrides or {}))
    # Checkpoints hold the shared embedding once (§3.4), not its tied copies: named here, the Trainer ties them again
    # when it loads the best checkpoint, instead of reporting them missing.
    model._keys_to_ignore_on_save = list(model.all_tied_weights_keys)
    corpus = load_parallel_corpus(data, source_lang, target_lang)

    def tokenize(batch: dict) -> dict:
        return tokenizer(batch[source_lang], text_target=batch[target_lang], truncation=True, max_length=max_length)

    tokenized = corpus.map(tokenize, batched=True, remove_columns=corpus["train"].column_names)

    def compute_metrics(prediction: EvalPrediction) -> dict:
        predictions = prediction.predictions
        labels = prediction.label_ids
        # Padding in predictions (and -100 in labels) is not text.
        predictions[predictions < 0] = tokenizer.pad_token_id
        labels[labels < 0] = tokenizer.pad_token_id
        hypotheses = tokenizer.batch_decode(predictions, skip_special_tokens=True)
        references = tokenizer.batch_decode(labels, skip_special_tokens=True)
        return {"bleu": corpus_bleu(hypotheses, references)["score"]}

    has_validation = "validation" in tokenized
    arguments = dict(
        output_dir=output_dir,
        predict_with_generate=True,
        eval_strategy="steps" if has_validation else "no",
        save_strategy="steps",
        load_best_model_at_end=has_validation,
        metric_for_best_model="bleu" if has_validation else None,
        save_total_limit=2,
        train_sampling_strategy="group_by_length",  # sentences of similar length together (§5.1)
        report_to="none",
    )
    arguments.update(training_arguments)
    return _Seq2SeqTrainer(
        model=model,
        args=Seq2SeqTrainingArguments(**arguments),
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"] if has_validation else None,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="saved translator directory or Hub id")
    corpus = parser.add_mutually_exclusive_group(required=True)
    corpus.add_argument("--data-dir", help="directory with train.<lang> and val.<lang> files")
    corpus.add_argument("--dataset", help="Hub dataset id")
    parser.add_argument("--source-lang", required=True, help="source language code, e.g. en")
    parser.add_argument("--target-lang", required=True, help="target language code, e.g. de")
    parser.add_argument("--output-dir", required=True, help="where checkpoints and the final model go")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (default: 1000)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="peak learning rate (default: 1e-4)")
    parser.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps (default: 100)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence pairs per device and step (default: 32)")
    parser.add_argument(
        "--gradient-accumulation-steps", type=int, default=1, help="batches per optimizer step (default: 1)"
    )
    parser.add_argument("--eval-steps", type=int, default=200, help="BLEU on the validation split every N steps")
    args = parser.parse_args()
    avoid_cudnn_attention()  # padded batches change shape from step to step
    try:  # a bad model, corpus or setting: one line, as the command line's errors are
        trainer = build_trainer(
            args.model,
            corpus_location(args.data_dir, args.dataset),
            args.source_lang,
            args.target_lang,
            args.output_dir,
            max_steps=args.max_steps,
            learning_rate=args.learning_rate,
            warmup_steps=args.warmup_steps,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            eval_steps=args.eval_steps,
            save_steps=args.eval_steps,
        )
    except (ValueError, OSError) as error:
        parser.error(str(error))
    trainer.train()
    save_translator(trainer.model, trainer.processing_class, args.output_dir)
    if trainer.eval_dataset is not None:
        print(trainer.evaluate())


if __name__ == "__main__":
    main()
