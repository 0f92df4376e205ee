"""Draw the attention heads of a saved model for one sentence pair, like the paper's Figures 3 to 5.

    python scripts/plot_attention.py MODEL_DIR "A man is riding a bicycle." --output attention.png
    python scripts/plot_attention.py MODEL_DIR "A dog runs." --target "Ein Hund rennt." --kind encoder --layer 0

Without --target the model translates the source first (its generation config: beam search) and
the heads are drawn for that translation. One heatmap per head: rows are the attending positions
(queries), columns the attended ones (keys), darker is more weight.
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

import vaswani_transformer  # noqa: E402, F401  (registers the Auto classes)

KINDS = {
    "encoder": ("encoder_attentions", "encoder self-attention"),
    "decoder": ("decoder_attentions", "decoder self-attention (masked)"),
    "cross": ("cross_attentions", "encoder-decoder attention"),
}


def attention_maps(model_dir: str, source: str, target: str | None = None):
    """Every layer's and head's attention weights for one sentence pair.

    Args:
        model_dir: a saved model with its tokenizer.
        source: the source sentence.
        target: its translation; None translates `source` with the model's generation config.

    Returns:
        The model output (`encoder_attentions`, `decoder_attentions`, `cross_attentions`: one
        `(1, heads, queries, keys)` tensor per layer), the source tokens and the decoder input tokens.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    inputs = tokenizer(source, return_tensors="pt")
    with torch.no_grad():
        if target is None:
            decoder_input_ids = model.generate(**inputs)[:, :-1]  # the inputs that produced the translation
        else:
            labels = tokenizer(text_target=target, return_tensors="pt")["input_ids"]
            decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
        output = model(**inputs, decoder_input_ids=decoder_input_ids, output_attentions=True)
    return output, _labels(tokenizer, inputs["input_ids"][0]), _labels(tokenizer, decoder_input_ids[0])


def _labels(tokenizer, ids: torch.Tensor) -> list[str]:
    # Readable subwords: byte-level BPE tokens like "Ġman" become "man".
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return [tokenizer.convert_tokens_to_string([token]).strip() or token for token in tokens]


def plot(output, source_tokens: list[str], target_tokens: list[str], kind: str, layer: int, path: Path) -> Path:
    """Save a grid of heatmaps, one per head, of one layer's attention of one kind, as a PNG.

    Args:
        output: a model output with attentions (see `attention_maps`).
        source_tokens, target_tokens: labels of the source positions and decoder input positions.
        kind: "encoder", "decoder" or "cross".
        layer: layer index, from 0; negative counts from the top.
        path: the PNG to write.

    Returns:
        `path`.

    Raises:
        ValueError: `layer` is not a layer of the model.
    """
    field, title = KINDS[kind]
    layers = getattr(output, field)
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"--layer {layer} is out of range: the model has {len(layers)} layers.")
    weights = layers[layer][0].float()
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
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="saved model directory (with its tokenizer)")
    parser.add_argument("source", help="source sentence")
    parser.add_argument("--target", default=None, help="target sentence (default: the model's own translation)")
    parser.add_argument("--kind", choices=sorted(KINDS), default="cross", help="which attention (default: cross)")
    parser.add_argument("--layer", type=int, default=-1, help="layer index from 0, negative from the top (default: -1)")
    parser.add_argument("--output", type=Path, default=Path("attention.png"), help="PNG file (default: attention.png)")
    args = parser.parse_args()
    output, source_tokens, target_tokens = attention_maps(args.model, args.source, args.target)
    try:
        print(plot(output, source_tokens, target_tokens, args.kind, args.layer, args.output))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
