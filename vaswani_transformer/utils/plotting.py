"""Pictures: attention heads like the paper's Figures 3 to 5, and learning curves.

Needs matplotlib (`pip install vaswani-transformer[plot]`); it is imported on first use.
"""

import json
from pathlib import Path
from types import ModuleType

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import Seq2SeqLMOutput

ATTENTION_KINDS = {
    "encoder": ("encoder_attentions", "encoder self-attention"),
    "decoder": ("decoder_attentions", "decoder self-attention (masked)"),
    "cross": ("cross_attentions", "encoder-decoder attention"),
}


def pyplot() -> ModuleType:
    """`matplotlib.pyplot`, drawing into files only (the Agg backend, no display needed).

    Call it before long work whose results are to be drawn, so that a missing matplotlib is reported first.

    Raises:
        ImportError: matplotlib is not installed; the message names the `plot` extra.
    """
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("Plotting needs matplotlib: pip install 'vaswani-transformer[plot]'.") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@torch.no_grad()
def attention_maps(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, source: str, target: str | None = None
) -> tuple[Seq2SeqLMOutput, list[str], list[str]]:
    """Every layer's and head's attention weights for one sentence pair (§3.2.3).

    Args:
        model: a translator with SDPA (the default, which spells out Eq. 1 when weights are asked
            for) or eager attention; flash attention and other kernels return no weights.
        tokenizer: its tokenizer.
        source: the source sentence; cut to the tokenizer's `model_max_length`, as translation cuts it.
        target: its translation; None translates `source` with the model's generation config.

    Returns:
        The model output (`encoder_attentions`, `decoder_attentions`, `cross_attentions`: one
        `(1, heads, queries, keys)` tensor per layer), the source tokens and the decoder input tokens.
    """
    inputs = tokenizer(source, return_tensors="pt", truncation=True).to(model.device)
    if target is None:
        decoder_input_ids = model.generate(**inputs)[:, :-1]  # the inputs that produced the translation
    else:
        labels = tokenizer(text_target=target, return_tensors="pt")["input_ids"].to(model.device)
        decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    output = model(**inputs, decoder_input_ids=decoder_input_ids, output_attentions=True)
    return output, _labels(tokenizer, inputs["input_ids"][0]), _labels(tokenizer, decoder_input_ids[0])


def _labels(tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor) -> list[str]:
    # Readable subwords: byte-level BPE tokens like "Ġman" become "man".
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return [tokenizer.convert_tokens_to_string([token]).strip() or token for token in tokens]


def plot_attention(
    output: Seq2SeqLMOutput, source_tokens: list[str], target_tokens: list[str], kind: str, layer: int, path: Path
) -> Path:
    """Save a grid of heatmaps, one per head, of one layer's attention of one kind, as a PNG.

    Rows are the attending positions (queries), columns the attended ones (keys); darker is more weight.

    See docs/training.md, "Table 3 variations and attention maps".

    Args:
        output: a model output with attentions (see `attention_maps`).
        source_tokens, target_tokens: labels of the source positions and decoder input positions.
        kind: "encoder", "decoder" or "cross".
        layer: layer index, from 0; negative counts from the top.
        path: the PNG to write.

    Returns:
        `path`.

    Raises:
        ValueError: `kind` is unknown, `layer` is not a layer of the model, or `output` has no attentions.
        ImportError: matplotlib is not installed (the `plot` extra).
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"Unknown attention kind {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}.")
    field, title = ATTENTION_KINDS[kind]
    layers = getattr(output, field)
    if not layers:
        raise ValueError("The output holds no attention weights: run the model with output_attentions=True, eager.")
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"Layer {layer} is out of range: the model has {len(layers)} layers.")
    plt = pyplot()
    weights = layers[layer][0].float().cpu()
    queries = source_tokens if kind == "encoder" else target_tokens
    keys = target_tokens if kind == "decoder" else source_tokens
    heads = weights.shape[0]
    columns = min(heads, 4)
    rows = (heads + columns - 1) // columns
    size = max(3.0, 0.28 * max(len(queries), len(keys)))
    figure, axes = plt.subplots(rows, columns, figsize=(size * columns, size * rows), squeeze=False)
    for head, axis in enumerate(axes.flat):
        if head >= heads:
            axis.axis("off")
            continue
        axis.imshow(weights[head].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        axis.set_title(f"head {head + 1}")
        axis.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
        axis.set_yticks(range(len(queries)), queries, fontsize=7)
    figure.suptitle(f"Layer {layer % len(layers) + 1} of {len(layers)}: {title}")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_learning_curve(log_path: str | Path, path: str | Path) -> Path:
    """Draw training and validation loss (nats per target token) and BLEU, when logged, against steps.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        log_path: a `training_log.jsonl` written by training (one JSON object per evaluation, with
            "step", "train_loss" and optionally "validation_loss" and "validation_bleu").
        path: the PNG to write.

    Returns:
        `path`.

    Raises:
        ValueError: the log holds no records.
        ImportError: matplotlib is not installed (the `plot` extra).
    """
    records = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{log_path} holds no training records to plot.")
    plt = pyplot()
    figure, loss_axis = plt.subplots(figsize=(7, 4))

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in records if key in r]
        return [s for s, _ in points], [v for _, v in points]

    train_steps, train_losses = series("train_loss")
    # A run shorter than --log-steps logs one training record: a line through it alone would draw nothing.
    marker = "." if len(train_steps) == 1 else None
    loss_axis.plot(train_steps, train_losses, label="training loss", color="tab:blue", alpha=0.6, marker=marker)
    loss_axis.plot(*series("validation_loss"), label="validation loss", color="tab:orange", marker="o")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss (nats per target token)")
    handles, names = loss_axis.get_legend_handles_labels()
    steps, bleu = series("validation_bleu")
    if bleu:
        bleu_axis = loss_axis.twinx()
        bleu_axis.plot(steps, bleu, label="validation BLEU", color="tab:green", marker="s")
        bleu_axis.set_ylabel("sacreBLEU")
        more_handles, more_names = bleu_axis.get_legend_handles_labels()
        handles, names = handles + more_handles, names + more_names
    loss_axis.legend(handles, names, loc="upper right")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
