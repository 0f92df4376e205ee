"""Draw the attention heads of a saved model for one sentence pair, like the paper's Figures 3 to 5.

    python scripts/plot_attention.py MODEL_DIR "A man is riding a bicycle." --output attention.png
    python scripts/plot_attention.py MODEL_DIR "A dog runs." --target "Ein Hund rennt." --kind encoder --layer 0

Without --target the model translates the source first (its generation config: beam search) and
the heads are drawn for that translation. One heatmap per head: rows are the attending positions
(queries), columns the attended ones (keys), darker is more weight.
"""

import argparse
from pathlib import Path

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import vaswani_transformer  # noqa: F401  (registers the Auto classes)
from vaswani_transformer.utils.plotting import ATTENTION_KINDS, attention_maps, plot_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="saved model directory (with its tokenizer)")
    parser.add_argument("source", help="source sentence")
    parser.add_argument("--target", default=None, help="target sentence (default: the model's own translation)")
    parser.add_argument(
        "--kind", choices=sorted(ATTENTION_KINDS), default="cross", help="which attention (default: cross)"
    )
    parser.add_argument("--layer", type=int, default=-1, help="layer index from 0, negative from the top (default: -1)")
    parser.add_argument("--output", type=Path, default=Path("attention.png"), help="PNG file (default: attention.png)")
    args = parser.parse_args()
    try:  # a bad model directory, layer or output path: one line, as the command line's errors are
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForSeq2SeqLM.from_pretrained(args.model, attn_implementation="eager").eval()
        output, source_tokens, target_tokens = attention_maps(model, tokenizer, args.source, args.target)
        print(plot_attention(output, source_tokens, target_tokens, args.kind, args.layer, args.output))
    except (ValueError, OSError) as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
