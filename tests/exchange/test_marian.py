"""Import of HF MarianMTModel: an independent implementation, matched logit for logit and beam for beam."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianConfig, MarianMTModel

from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_transformer.cli import main
from vaswani_transformer.exchange.marian import from_marian, marian_to_interleaved_permutation, to_marian
from vaswani_transformer.inference.engines import TorchEngine
from vaswani_transformer.inference.translation import translate
from vaswani_transformer.model.layers_vaswani import SinusoidalPositionalEncoding


def random_marian(vocab_size: int, pad: int, eos: int, seed: int, **sizes) -> MarianMTModel:
    """A MarianMTModel with every weight random, LayerNorms and `final_logits_bias` included."""
    torch.manual_seed(seed)
    options = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64)
    options.update(sizes)
    config = MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        decoder_layers=options["encoder_layers"],
        decoder_attention_heads=options["encoder_attention_heads"],
        decoder_ffn_dim=options["encoder_ffn_dim"],
        activation_function="swish",  # as in the OPUS-MT models
        scale_embedding=True,
        pad_token_id=pad,
        eos_token_id=eos,
        decoder_start_token_id=pad,
        forced_eos_token_id=eos,
        max_position_embeddings=512,
        **options,
    )
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "embed_positions" not in name:
                parameter.normal_(0.0, 0.3 if parameter.ndim > 1 else 0.5)
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, eos] += 2.0  # so that hypotheses finish and the length penalty matters
    return model


def test_marian_sinusoids_are_a_permutation_of_the_papers():
    marian = random_marian(50, pad=49, eos=0, seed=0, d_model=16, encoder_attention_heads=2)
    table = marian.model.encoder.embed_positions.weight[:40]
    ours = SinusoidalPositionalEncoding(16)(torch.arange(40))
    torch.testing.assert_close(table[:, marian_to_interleaved_permutation(16)], ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "vocab_size, pad, eos, sizes, padding_side",
    [
        (101, 100, 0, {}, "right"),  # Marian's layout: </s> first, <pad> last
        (64, 0, 2, dict(d_model=48, encoder_attention_heads=3, encoder_ffn_dim=96), "left"),
        (300, 299, 0, dict(d_model=64, encoder_layers=3, encoder_attention_heads=8, encoder_ffn_dim=32), "right"),
    ],
)
def test_converted_marian_gives_the_same_logits_and_beams(vocab_size, pad, eos, sizes, padding_side):
    marian = random_marian(vocab_size, pad, eos, seed=vocab_size, **sizes)
    ours = from_marian(marian)
    generator = torch.Generator().manual_seed(1)
    lengths = [9, 4, 7, 1]
    batches = {side: (torch.full((4, 9), pad), torch.zeros(4, 9, dtype=torch.long)) for side in ("right", "left")}
    for row, length in enumerate(lengths):
        tokens = torch.randint(0, vocab_size, (length,), generator=generator)
        tokens = tokens.masked_fill(tokens == pad, eos)
        for side, (input_ids, attention_mask) in batches.items():
            where = slice(0, length) if side == "right" else slice(9 - length, 9)
            input_ids[row, where], attention_mask[row, where] = tokens, 1
    decoder_input_ids = torch.cat(
        [torch.full((4, 1), pad), torch.randint(0, vocab_size, (4, 6), generator=generator)], dim=1
    )
    # Marian moves a left-padded sentence's positions by its padding; ours start at its first token (§3.5), so
    # ours on either side is held to Marian on the right.
    reference = dict(zip(("input_ids", "attention_mask"), batches["right"], strict=True))
    inputs = dict(zip(("input_ids", "attention_mask"), batches[padding_side], strict=True))
    with torch.no_grad():
        expected = marian(**reference, decoder_input_ids=decoder_input_ids).logits
        actual = ours(**inputs, decoder_input_ids=decoder_input_ids).logits
    assert (actual - expected).abs().max() < 1e-4
    decoding = dict(num_beams=4, max_new_tokens=15)
    assert torch.equal(ours.generate(**inputs, **decoding), marian.generate(**reference, **decoding))


def test_converted_marian_matches_on_every_multi30k_test_sentence(tokenizer, corpus):
    marian = random_marian(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=3)
    ours = from_marian(marian)
    sources = corpus["test_2016_flickr"]["en"]
    assert len(sources) == 1000
    for start in range(0, len(sources), 125):
        inputs = tokenizer(sources[start : start + 125], padding=True, return_tensors="pt")
        expected = marian.generate(**inputs, num_beams=4, max_new_tokens=12)
        assert torch.equal(ours.generate(**inputs, num_beams=4, max_new_tokens=12), expected), start


def test_convert_marian_command_keeps_marians_tokenizer_and_decoding(tmp_path, corpus, capsys, caplog):
    import sentencepiece as spm
    from transformers import MarianTokenizer

    # A Marian directory as OPUS-MT ships them: SentencePiece models and a vocab.json.
    text = tmp_path / "text.txt"
    text.write_text("\n".join(corpus["train"]["en"][:5000] + corpus["train"]["de"][:5000]), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "spm"), vocab_size=800, pad_id=-1, eos_id=0, unk_id=1, bos_id=-1
    )
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    vocab["<pad>"] = len(vocab)
    marian_dir = tmp_path / "marian"
    marian_dir.mkdir()
    for name in ("source.spm", "target.spm"):
        (marian_dir / name).write_bytes((tmp_path / "spm.model").read_bytes())
    (marian_dir / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    marian_tokenizer = MarianTokenizer(
        str(marian_dir / "source.spm"), str(marian_dir / "target.spm"), str(marian_dir / "vocab.json")
    )
    marian_tokenizer.save_pretrained(marian_dir)
    marian = random_marian(len(vocab), pad=vocab["<pad>"], eos=vocab["</s>"], seed=4)
    marian.generation_config.num_beams = 3
    marian.generation_config.max_length = 20
    marian.save_pretrained(marian_dir)

    saved = {path.name: path.read_bytes() for path in marian_dir.iterdir()}
    assert main(["convert-marian", str(marian_dir), str(marian_dir)]) == 2, "converting over the source is refused"
    assert {path.name: path.read_bytes() for path in marian_dir.iterdir()} == saved, "and leaves the Marian model"
    assert main(["convert-marian", str(marian_dir), str(tmp_path / "converted")]) == 0
    assert main(["convert-marian", str(marian_dir), str(tmp_path / "paper"), "--paper-decoding"]) == 0
    # Refused before anything is written: into a model's directory, from a Hub id, from a model without a tokenizer.
    before = {path.name: path.read_bytes() for path in (tmp_path / "paper").iterdir()}
    assert main(["convert-marian", str(marian_dir), str(tmp_path / "paper")]) == 2
    assert {path.name: path.read_bytes() for path in (tmp_path / "paper").iterdir()} == before
    assert main(["convert-marian", "Helsinki-NLP/opus-mt-en-de", str(tmp_path / "hub")]) == 2
    untokenized = tmp_path / "no-tokenizer"
    marian.save_pretrained(untokenized)
    assert main(["convert-marian", str(untokenized), str(tmp_path / "none")]) == 2
    assert not (tmp_path / "hub").exists() and not (tmp_path / "none").exists()
    # A model of another kind (here this package's own, converted above) is named as such, not loaded as Marian.
    capsys.readouterr()
    assert main(["convert-marian", str(tmp_path / "converted"), str(tmp_path / "again")]) == 2
    assert "holds a vaswani_transformer model, not a Marian one" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()

    converted_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "converted")
    assert type(converted_tokenizer).__name__ == "MarianTokenizer"
    sentences = corpus["test_2016_flickr"]["en"][:16]
    inputs = converted_tokenizer(sentences, padding=True, return_tensors="pt")
    assert torch.equal(inputs["input_ids"], marian_tokenizer(sentences, padding=True, return_tensors="pt")["input_ids"])
    converted = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "converted")
    assert type(converted).__name__ == "VaswaniForConditionalGeneration"
    # Marian's decoding (its beam size, HF's length penalty, its maximum length) unless asked otherwise.
    assert converted.generation_config.num_beams == 3 and converted.generation_config.max_length == 20
    assert getattr(converted.generation_config, "length_penalty_type", None) is None
    assert torch.equal(converted.generate(**inputs), marian.generate(**inputs))
    paper = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "paper")
    assert paper.generation_config.length_penalty_type == "gnmt" and paper.generation_config.num_beams == 4

    # Marian's tokenizer is a slow one, with no offsets to align words by: HTML is translated with its markup placed
    # by word order, and alignments are refused in one line.
    engine = TorchEngine(converted, converted_tokenizer)
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.inference.alignment"):
        [html] = translate(engine, converted_tokenizer, ["<p>A <b>dog</b> runs.</p>"], text_format="html")
    assert html.startswith("<p>") and html.endswith("</p>") and html.count("<b>") == html.count("</b>") == 1
    assert "MarianTokenizer is a slow tokenizer" in caplog.text
    with pytest.raises(ValueError, match="Cannot align words: MarianTokenizer is a slow tokenizer"):
        translate(engine, converted_tokenizer, sentences[:1], alignments=True)


@pytest.mark.parametrize(
    "option, reason",
    [
        (dict(decoder_vocab_size=50, share_encoder_decoder_embeddings=False), "share_encoder_decoder_embeddings"),
        (dict(tie_word_embeddings=False), "tie_word_embeddings"),
    ],
)
def test_marian_the_paper_cannot_express_is_refused_with_the_reason(option, reason):
    config = MarianConfig(
        vocab_size=60, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=49,
        decoder_start_token_id=49, eos_token_id=0, **option,
    )  # fmt: skip
    with pytest.raises(ValueError, match=reason):
        from_marian(MarianMTModel(config))


def test_a_model_marian_cannot_express_is_not_exported_and_every_reason_is_named():
    small = dict(vocab_size=60, d_model=16, d_ff=32, encoder_layers=1, decoder_layers=1, num_attention_heads=2)
    options = dict(
        d_k=4, normalize_before=True, position_embedding_type="learned", scale_attention=False, layer_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip
    reasons = ["d_k=4", "pre-LayerNorm", "learned positional", "attention without the 1/sqrt", "layer_norm_eps=1e-06"]
    reasons += ["untied output projection"]
    for option, reason in zip(options.items(), reasons, strict=True):
        with pytest.raises(ValueError, match=f"no exact HF Marian equivalent: it has {reason}"):
            to_marian(VaswaniForConditionalGeneration(VaswaniConfig(**small, **dict([option]))))
    with pytest.raises(ValueError, match="; ".join(["d_k=4.*", "pre-LayerNorm.*", "learned.*"])):
        to_marian(
            VaswaniForConditionalGeneration(
                VaswaniConfig(**small, d_k=4, normalize_before=True, position_embedding_type="learned")
            )
        )
