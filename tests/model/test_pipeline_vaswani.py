"""A saved model without the package: trust_remote_code loads its copied code and pipeline (pipeline_vaswani.py)."""

import json
from pathlib import Path

import pytest
from conftest import random_model, run_without_package
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import vaswani_transformer
from vaswani_transformer import VaswaniForConditionalGeneration

# The modules `trust_remote_code` runs: the model's file and, through its relative imports, every other `*_vaswani.py`.
MODEL_CODE = {path.name for path in (Path(vaswani_transformer.__file__).parent / "model").glob("*_vaswani.py")}
SENTENCES = ["A man is riding a bicycle down the street.", "Two dogs play in the snow."]

WITHOUT_PACKAGE = """
import json, sys
from transformers import AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
path, sentences = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=True)
base_model = AutoModel.from_pretrained(path, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
translator = pipeline("translation", model=path, trust_remote_code=True)
ids = model.generate(**tokenizer(sentences, padding=True, return_tensors="pt"))
print(json.dumps({
    "model_class": type(model).__module__,
    "base_model_class": f"{type(base_model).__module__}.{type(base_model).__name__}",
    "same_weights": all(v.equal(model.model.state_dict()[k]) for k, v in base_model.state_dict().items()),
    "generate": tokenizer.batch_decode(ids, skip_special_tokens=True),
    "pipeline": [t["translation_text"] for t in translator(sentences)],
}))
"""


def test_save_pretrained_copies_the_model_code_and_nothing_else(tmp_path):
    random_model().save_pretrained(tmp_path)
    assert {path.name for path in tmp_path.glob("*.py")} == MODEL_CODE


def test_a_fresh_environment_without_the_package_translates_like_the_package(trained_model_dir, tmp_path):
    assert {path.name for path in trained_model_dir.glob("*.py")} == MODEL_CODE
    # A model re-saved by its own save_pretrained (as push_to_hub saves it) carries everything too.
    saved = tmp_path / "resaved"
    AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).save_pretrained(saved)
    AutoTokenizer.from_pretrained(trained_model_dir).save_pretrained(saved)
    result = run_without_package(WITHOUT_PACKAGE, str(saved), json.dumps(SENTENCES), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    without = json.loads(result.stdout.strip().splitlines()[-1])
    # The classes came from the directory's copied code, not from an installed package.
    assert without["model_class"].startswith("transformers_modules."), without["model_class"]
    # AutoModel gives the base model (no output projection), with the saved weights.
    assert without["base_model_class"].startswith("transformers_modules.") and without["base_model_class"].endswith(
        ".modeling_vaswani.VaswaniModel"
    ), without["base_model_class"]
    assert without["same_weights"]

    # With the package: its own classes (no remote code), the same translations.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir)
    assert type(model) is VaswaniForConditionalGeneration
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    ids = model.generate(**tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    expected = tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert all(expected)
    assert without["pipeline"] == without["generate"] == expected


def test_the_pipeline_gives_each_input_its_own_translations_in_batches(trained_model_dir):
    from transformers import pipeline

    translator = pipeline("translation", model=str(trained_model_dir), trust_remote_code=True)
    sentences = [*SENTENCES, "A girl sings on a stage.", "   ", ""]
    best = [result["translation_text"] for result in translator(sentences, batch_size=2)]
    several = translator(sentences, num_return_sequences=2, batch_size=2)
    assert [len(hypotheses) for hypotheses in several] == [2] * len(sentences)
    assert [hypotheses[0]["translation_text"] for hypotheses in several] == best, "each input's own best first"
    assert all(best[:3]) and best[3:] == ["", ""], "blank inputs translate to blank outputs, as translate() does"
    assert all(h["translation_text"] == "" for hypotheses in several[3:] for h in hypotheses)


def test_the_pipeline_takes_transformers_4s_tokenizer_options(trained_model_dir):
    from transformers import pipeline

    translator = pipeline("translation", model=str(trained_model_dir), trust_remote_code=True)
    limit = translator.tokenizer.model_max_length
    long = " ".join(["dog"] * (limit + 20))
    assert translator.preprocess(long)["input_ids"].shape[1] == limit
    assert translator.preprocess(long, truncation=False)["input_ids"].shape[1] > limit
    # Per call, as transformers 4's translation pipeline took them; they went to generate(), which refused them.
    best = translator(SENTENCES[0])[0]["translation_text"]
    options = dict(truncation=False, clean_up_tokenization_spaces=False)
    assert translator(SENTENCES[0], **options)[0]["translation_text"] == best


def test_the_pipeline_translates_an_empty_list_into_an_empty_list(tokenizer, tmp_path):
    # As translate([]) does; transformers' pipeline failed on it with an IndexError.
    from transformers import pipeline

    random_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    translator = pipeline("translation", model=str(tmp_path), trust_remote_code=True)
    assert translator([]) == [] and translator([], num_return_sequences=2, batch_size=2) == []


def test_the_pipeline_takes_the_language_arguments_of_the_model_and_refuses_others(tokenizer, tmp_path, caplog):
    # transformers' translation pipeline takes src_lang and tgt_lang; they went to generate(), which refused them
    # ("model_kwargs are not used"). The model translates one pair: they are checked against it, in one line.
    from transformers import pipeline

    random_model(tokenizer, source_lang="en", target_lang="de").save_pretrained(tmp_path / "en-de")
    random_model(tokenizer).save_pretrained(tmp_path / "unsaid")  # saved before the config named its languages
    for name in ("en-de", "unsaid"):
        tokenizer.save_pretrained(tmp_path / name)
    translator = pipeline("translation", model=str(tmp_path / "en-de"), trust_remote_code=True, max_new_tokens=5)
    expected = translator(SENTENCES)
    assert translator(SENTENCES, src_lang="en", tgt_lang="de") == expected
    assert translator(SENTENCES, src_lang="en_XX", tgt_lang="DE-de") == expected  # mBART's and BCP 47's forms
    for language in ({"src_lang": "fr"}, {"tgt_lang": "en"}):
        ((name, code),) = language.items()
        message = f"This model translates en to de, not {name}='{code}': give {name}="
        with pytest.raises(ValueError, match=message):
            translator(SENTENCES, **language)
        with pytest.raises(ValueError, match=message):
            pipeline("translation", model=str(tmp_path / "en-de"), trust_remote_code=True, **language)
    with pytest.raises(ValueError, match="src_lang must be a language code such as 'en', got 3"):
        translator(SENTENCES, src_lang=3)
    unsaid = pipeline("translation", model=str(tmp_path / "unsaid"), trust_remote_code=True, max_new_tokens=5)
    with caplog.at_level("WARNING"):
        assert unsaid(SENTENCES, src_lang="fr") == unsaid(SENTENCES)
    assert (
        "does not say which languages it translates" in caplog.text
        and "src_lang='fr' is taken unchecked" in caplog.text
    )
