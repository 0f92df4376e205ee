"""Export to CTranslate2: the served model translates Multi30k exactly as our generate() does."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

from vaswani_transformer.cli import main
from vaswani_transformer.exchange.ctranslate2 import ensure_ctranslate2_export
from vaswani_transformer.inference.engines import load_ctranslate2_engine
from vaswani_transformer.inference.translation import translate

ctranslate2 = pytest.importorskip("ctranslate2")


@pytest.fixture(scope="module")
def exported(trained_model_dir, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("ct2") / "model"
    assert main(["export-ctranslate2", str(trained_model_dir), str(output_dir)]) == 0
    return output_dir


def test_ctranslate2_beam_search_gives_our_generate_output_on_multi30k(trained_model_dir, exported, corpus):
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    translator = ctranslate2.Translator(str(exported), device="cpu", intra_threads=2)
    sources = corpus["test_2016_flickr"]["en"][:96]
    # CTranslate2 has HF's length normalisation (score / length ** penalty), not the GNMT penalty of §6.1.
    decoding = dict(num_beams=4, length_penalty=1.0, length_penalty_type="hf", max_length_a=None, max_length_b=None)
    ours, theirs = [], []
    for start in range(0, len(sources), 32):
        batch = sources[start : start + 32]
        output = model.generate(**tokenizer(batch, padding=True, return_tensors="pt"), **decoding, max_new_tokens=40)
        special = {tokenizer.pad_token_id, tokenizer.eos_token_id, model.config.decoder_start_token_id}
        ours += [[t for t in row.tolist()[1:] if t not in special] for row in output]
        tokens = [tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in batch]
        results = translator.translate_batch(tokens, beam_size=4, length_penalty=1.0, max_decoding_length=40)
        theirs += [tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results]
    assert sum(len(ids) for ids in ours) > 5 * len(sources)  # real translations, not empty ones
    assert ours == theirs


def test_ctranslate2_scores_are_our_log_probabilities(trained_model_dir, exported, corpus):
    # Same decoder start (<s>, not CTranslate2's Marian zero vector) and every vocabulary row kept.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    translator = ctranslate2.Translator(str(exported), device="cpu")
    source, target = corpus["test_2016_flickr"]["en"][0], corpus["test_2016_flickr"]["de"][0]
    source_tokens = tokenizer.convert_ids_to_tokens(tokenizer(source)["input_ids"])
    target_ids = tokenizer(text_target=target)["input_ids"]
    (score,) = translator.score_batch([source_tokens], [tokenizer.convert_ids_to_tokens(target_ids[:-1])])
    with torch.no_grad():
        logits = model(**tokenizer(source, return_tensors="pt"), labels=torch.tensor([target_ids])).logits
    # CTranslate2 gives <pad> and <s> a logit of -inf (never generated), so it normalises over the other tokens.
    logits[..., [tokenizer.pad_token_id, tokenizer.bos_token_id]] = -torch.inf
    log_probs = logits.log_softmax(-1)[0].gather(-1, torch.tensor(target_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(score.log_probs), log_probs, atol=2e-5, rtol=0)


def test_export_refuses_to_overwrite_and_explains(trained_model_dir, exported, capsys):
    assert main(["export-ctranslate2", str(trained_model_dir), str(exported)]) == 2
    assert "--force" in capsys.readouterr().err


def _flip_weights(model_dir):
    weights = model_dir / "model.safetensors"
    save_file({name: tensor.flip(0) for name, tensor in load_file(weights).items()}, weights, metadata={"format": "pt"})


def test_a_cached_export_is_made_again_for_other_weights_of_the_same_size_and_time(trained_model_dir, tmp_path):
    # A checkpoint copied over the model (`cp -p` keeps its time) must not be translated by the old export.
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model_dir, model_dir)
    first = ensure_ctranslate2_export(str(model_dir))
    made, exported_bytes = (first / "model.bin").stat().st_mtime_ns, (first / "model.bin").read_bytes()
    reused = ensure_ctranslate2_export(str(model_dir))
    assert reused == first and (first / "model.bin").stat().st_mtime_ns == made
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    _flip_weights(model_dir)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert (ensure_ctranslate2_export(str(model_dir)) / "model.bin").read_bytes() != exported_bytes


def test_an_export_the_user_named_is_never_replaced_by_one_of_other_weights(trained_model_dir, tmp_path, capsys):
    # `--ctranslate2-dir` names the user's own export (here an int8 one of the weights before they changed): one of
    # other weights is refused, not replaced, where the model's own cache (MODEL/ctranslate2) is made again.
    model_dir = shutil.copytree(trained_model_dir, tmp_path / "model", ignore=shutil.ignore_patterns("ctranslate2"))
    theirs = tmp_path / "theirs"
    assert main(["export-ctranslate2", str(trained_model_dir), str(theirs), "--quantization", "int8"]) == 0
    _flip_weights(model_dir)
    exported_bytes = (theirs / "model.bin").read_bytes()
    with pytest.raises(ValueError, match=rf"{theirs} holds a CTranslate2 export of other weights .* --force"):
        ensure_ctranslate2_export(str(model_dir), theirs)
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n")
    argv = ["translate", "--model", str(model_dir), "--input", str(source), "--engine", "ctranslate2"]
    assert main([*argv, "--ctranslate2-dir", str(theirs)]) == 2
    assert "export-ctranslate2" in capsys.readouterr().err and (theirs / "model.bin").read_bytes() == exported_bytes
    assert ensure_ctranslate2_export(str(trained_model_dir), theirs) == theirs  # its own model's weights: used


def test_the_ctranslate2_engine_refuses_a_device_it_cannot_use_before_exporting(trained_model_dir, tmp_path, capsys):
    model_dir = shutil.copytree(trained_model_dir, tmp_path / "model", ignore=shutil.ignore_patterns("ctranslate2"))
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n")
    argv = ["translate", "--model", str(model_dir), "--input", str(source), "--engine", "ctranslate2"]
    devices = ["cuda:1", "mps"] + (["cuda"] if ctranslate2.get_cuda_device_count() == 0 else [])
    for device in devices:
        assert main([*argv, "--device", device]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "CTranslate2" in err, err
    assert not (model_dir / "ctranslate2").exists()  # refused before any export
    with pytest.raises(OSError, match=r"does-not-exist does not exist; give a model directory"):
        ensure_ctranslate2_export(str(tmp_path / "does-not-exist"))


def test_weights_replaced_during_an_export_are_not_recorded_as_exported(trained_model_dir, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model_dir, model_dir, ignore=shutil.ignore_patterns("checkpoints"))
    convert = ctranslate2.converters.TransformersConverter.convert

    def convert_then_replace_the_weights(self, *args, **kwargs):
        output = convert(self, *args, **kwargs)
        _flip_weights(model_dir)  # a checkpoint copied over the model while it was being converted
        return output

    monkeypatch.setattr(ctranslate2.converters.TransformersConverter, "convert", convert_then_replace_the_weights)
    old_export = (ensure_ctranslate2_export(str(model_dir)) / "model.bin").read_bytes()
    monkeypatch.undo()
    assert (ensure_ctranslate2_export(str(model_dir)) / "model.bin").read_bytes() != old_export  # made again


def test_two_exports_at_once_both_end_with_the_export(trained_model_dir, tmp_path, monkeypatch):
    # The other export (a thread or process) finishes between this one's removal of the old export and its rename.
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model_dir, model_dir, ignore=shutil.ignore_patterns("checkpoints"))
    target, rmtree, other = model_dir / "ctranslate2", shutil.rmtree, []

    def remove_then_let_the_other_export_finish(path, *args, **kwargs):
        rmtree(path, *args, **kwargs)
        if path == target and not other:
            other.append("started")
            other.append(ensure_ctranslate2_export(str(model_dir)))

    monkeypatch.setattr(shutil, "rmtree", remove_then_let_the_other_export_finish)
    assert ensure_ctranslate2_export(str(model_dir)) == target and other == ["started", target]
    assert (target / "model.bin").is_file()
    assert not [path.name for path in model_dir.iterdir() if "partial" in path.name]  # no private copy left


def test_translate_with_the_ctranslate2_engine_gives_nearly_all_the_torch_translations(
    trained_model_dir, corpus, tmp_path, capsys
):
    # The model's own decoding (§6.1): GNMT length penalty, which CTranslate2 lacks and the engine applies itself.
    assert GenerationConfig.from_pretrained(trained_model_dir).length_penalty_type == "gnmt"
    sources = corpus["test_2016_flickr"]["en"][:96]
    source_file = tmp_path / "test.en"
    source_file.write_text("\n".join(sources) + "\n")
    translations = {}
    for engine in ("torch", "ctranslate2"):
        arguments = ["translate", "--model", str(trained_model_dir), "--input", str(source_file), "--engine", engine]
        assert main([*arguments, "--ctranslate2-dir", str(tmp_path / "ct2")]) == 0
        translations[engine] = capsys.readouterr().out.splitlines()
    assert (tmp_path / "ct2" / "model.bin").is_file()  # the export, cached for the next call
    assert len(translations["torch"]) == len(sources)
    assert sum(len(t.split()) for t in translations["torch"]) > 5 * len(sources)  # real translations
    # CTranslate2's beam search is not transformers' to the last tie: on the main job's model 982 of the 1,000
    # test sentences come out the same (docs/serving.md); a wrong penalty or an early stop costs far more.
    same = sum(a == b for a, b in zip(translations["ctranslate2"], translations["torch"], strict=True))
    assert same >= 0.95 * len(sources)


def test_the_ctranslate2_engine_takes_the_length_penalty_asked_for(trained_model_dir, exported, corpus):
    sources = corpus["test_2016_flickr"]["en"][:48]
    model = load_ctranslate2_engine(str(trained_model_dir), ct2_dir=exported)
    tokenizer = model.tokenizer
    default = translate(model, tokenizer, sources)
    model = load_ctranslate2_engine(str(trained_model_dir), ct2_dir=exported, length_penalty=3.0)
    tokenizer = model.tokenizer
    longer = translate(model, tokenizer, sources)
    torch_model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir)
    expected = translate(torch_model, tokenizer, sources, length_penalty=3.0)
    # A penalty left at the default would give the default's translations, not nearly all of generate()'s at 3.0
    # (the two searches differ in which candidates may end at a step, which a large alpha weighs more).
    assert sum(a != b for a, b in zip(default, expected, strict=True)) >= 5
    assert sum(a == b for a, b in zip(longer, expected, strict=True)) >= 0.9 * len(sources)


def test_the_ctranslate2_engine_stops_at_max_new_tokens_as_generate_does(trained_model_dir, exported, corpus):
    from vaswani_transformer.inference.engines import CTranslate2Engine

    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    config = GenerationConfig.from_pretrained(trained_model_dir)
    config.max_new_tokens = 5
    sources = corpus["test_2016_flickr"]["en"][:16]
    translations = CTranslate2Engine(exported, tokenizer, config).translate(sources)
    lengths = [len(tokenizer(text_target=t, add_special_tokens=False)["input_ids"]) for t in translations]
    assert max(lengths) <= 5 < max(len(s.split()) for s in sources), "cut where generate() cuts"


def test_a_ctranslate2_engine_refuses_generate_arguments(trained_model_dir, exported):
    engine = load_ctranslate2_engine(str(trained_model_dir), ct2_dir=exported)
    tokenizer = engine.tokenizer
    with pytest.raises(ValueError, match="num_beams"):
        translate(engine, tokenizer, ["A dog runs."], num_beams=2)
    with pytest.raises(ValueError, match="use 1 for a model on a GPU or a CTranslate2 engine"):
        translate(engine, tokenizer, ["A dog runs."], num_workers=2)
    assert translate(engine, tokenizer, ["A dog runs.", " "])[1] == ""


def test_a_ctranslate2_engine_refuses_zero_beams_as_generate_does(trained_model_dir, exported, tmp_path, capsys):
    for beams in (0, -1):
        with pytest.raises(ValueError, match="num_beams must be at least 1"):
            load_ctranslate2_engine(str(trained_model_dir), ct2_dir=exported, num_beams=beams)
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n")
    argv = ["translate", "--model", str(trained_model_dir), "--input", str(source), "--num-beams", "0"]
    assert main([*argv, "--engine", "ctranslate2", "--ctranslate2-dir", str(exported)]) == 2
    assert "num_beams must be at least 1" in capsys.readouterr().err


def test_the_engine_reads_and_writes_within_the_position_table_of_its_export(trained_model_dir, tmp_path, corpus):
    short = tmp_path / "short"
    assert main(["export-ctranslate2", str(trained_model_dir), str(short), "--max-positions", "12"]) == 0
    engine = load_ctranslate2_engine(str(trained_model_dir), ct2_dir=short)
    tokenizer = engine.tokenizer
    calls = []

    class Recording:  # CTranslate2's translator, with each call's tokens, options and hypotheses kept
        def __init__(self, translator):
            self.translator = translator

        def translate_batch(self, tokens, **options):
            results = self.translator.translate_batch(tokens, **options)
            calls.append((tokens, options, [h for result in results for h in result.hypotheses]))
            return results

    engine.translator = Recording(engine.translator)
    long_source = max(corpus["test_2016_flickr"]["en"][:100], key=len)
    assert len(tokenizer(long_source).input_ids) > 12
    translate(engine, tokenizer, [long_source], long_inputs="truncate")
    ((tokens, options, hypotheses),) = calls
    # A table of 12 positions, where the default's 1,024 would have let CTranslate2 read and write past it.
    assert max(map(len, tokens)) <= 12 and options["max_input_length"] <= 12
    assert options["max_decoding_length"] <= 12 and max(map(len, hypotheses)) <= 12


def test_the_export_of_a_hub_model_is_cached_outside_the_hubs_own_cache(trained_model_dir, tmp_path):
    # The Hub's cache (`hf cache`) holds a repository's files and nothing else: the export has a cache of its own.
    from hub_server import LocalHub
    from test_hub import TOKEN, run_client

    (tmp_path / "in.en").write_text("A dog runs.\n")
    home = tmp_path / "home"
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub:
        model = hub.repo_dir("org/translator")
        shutil.copytree(trained_model_dir, model, ignore=shutil.ignore_patterns("checkpoints", "ctranslate2"))
        arguments = ["--model", "org/translator", "--input", str(tmp_path / "in.en"), "--engine", "ctranslate2"]
        result = run_client(hub, home, "-m", "vaswani_transformer.cli", "translate", *arguments)
    assert result.stdout.strip() and not hub.errors
    (snapshot,) = (home / "hub" / "models--org--translator" / "snapshots").iterdir()
    assert (snapshot / "model.safetensors").is_file() and not (snapshot / "ctranslate2").exists()
    assert (home / "vaswani_transformer" / "ctranslate2" / f"org--translator--{snapshot.name}" / "model.bin").is_file()
