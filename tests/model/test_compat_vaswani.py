"""compat_vaswani: one model on every supported transformers release, and a clear refusal outside them."""

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPOSITORY, random_model, run_without_package
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from vaswani_transformer.model import compat_vaswani

MODEL_DIR = REPOSITORY / "vaswani_transformer" / "model"

# Models saved by releases 0.1 and 0.2 with their code (tests/fixtures/make_saved_model.py) and what they translated
# then: 0.2's code is the last that chose kernels by measuring them, and laid the package out flat.
FIXTURES = REPOSITORY / "tests" / "fixtures"
# The Python of the other end of the supported range (scripts/test.sh sets it), for saving under one end and
# loading under the other.
OTHER_END = os.environ.get("VASWANI_OTHER_END_PYTHON")
needs_other_end = pytest.mark.skipif(not OTHER_END, reason="VASWANI_OTHER_END_PYTHON unset (scripts/test.sh sets it)")

TRANSLATE = """
import json, sys
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
path, sentences = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
ids = model.generate(**tokenizer(sentences, padding=True, return_tensors="pt"))
translator = pipeline("translation", model=path, trust_remote_code=True)
print(json.dumps({
    "module": type(model).__module__,
    "generate": tokenizer.batch_decode(ids, skip_special_tokens=True),
    "pipeline": [t["translation_text"] for t in translator(sentences)],
}))
"""


def translate_with_package(path: Path, sentences: list[str]) -> list[str]:
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    ids = model.generate(**tokenizer(sentences, padding=True, return_tensors="pt"))
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def translate_without_package(path: Path, sentences: list[str], cwd: Path, **python) -> dict:
    result = run_without_package(TRANSLATE, str(path), json.dumps(sentences), cwd=cwd, **python)
    assert result.returncode == 0, result.stderr[-3000:]
    translated = json.loads(result.stdout.strip().splitlines()[-1])
    assert translated["module"].startswith("transformers_modules."), "the saved code ran, not the package"
    return translated


@pytest.mark.parametrize("version", ["4.57.6", "5.19.0", "6.0.0"])
def test_a_release_outside_the_range_is_refused_in_one_line_naming_both(version):
    with pytest.raises(ImportError) as refused:
        compat_vaswani.check_transformers_version(version)
    message = str(refused.value)
    assert "\n" not in message and version in message and compat_vaswani.SUPPORTED_TRANSFORMERS in message
    assert "pip install -U" in message


def test_the_ends_of_the_range_are_accepted_and_the_running_release_lies_in_it():
    import transformers

    for version in (compat_vaswani.MINIMUM_TRANSFORMERS, "5.99.1", transformers.__version__):
        compat_vaswani.check_transformers_version(version)


def test_a_saved_model_refuses_to_load_under_a_release_outside_the_range(trained_model_dir, tmp_path):
    # A transformers that says it is 4.57.6: the saved code stops at import, before any weight or translation.
    code = (
        "import sys\nfrom transformers import AutoModelForSeq2SeqLM\n"
        "sys.modules['transformers'].__version__ = '4.57.6'\n"
        "AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True)\nprint('loaded')"
    )
    result = run_without_package(code, str(trained_model_dir), cwd=tmp_path)
    assert result.returncode != 0 and "loaded" not in result.stdout
    assert "needs transformers>=" in result.stderr and "this environment has 4.57.6" in result.stderr


@pytest.mark.parametrize("name", ["past", "cache_position", "cache_params", "decoder_past_key_values", "mems"])
def test_forward_refuses_a_cache_it_would_drop_naming_it(tokenizer, test_sentences, name):
    model = random_model(tokenizer)
    batch = tokenizer(test_sentences[0][:2], padding=True, return_tensors="pt")
    for module, arguments in (
        (model, dict(**batch, decoder_input_ids=batch["input_ids"][:, :3])),
        (model.get_encoder(), dict(batch)),
    ):
        with pytest.raises(TypeError, match=name):
            module(**arguments, **{name: None})


def test_the_decoder_refuses_any_argument_it_would_drop_and_the_encoder_what_generate_hands_it(tokenizer):
    model = random_model(tokenizer)
    batch = tokenizer(["A dog runs."], return_tensors="pt")
    with pytest.raises(TypeError, match="beam_idx"):
        model(**batch, decoder_input_ids=batch["input_ids"][:, :1], beam_idx=None)
    # generate() gives the encoder every model input (the Trainer's labels among them), as transformers does.
    encoded = model.get_encoder()(**batch, labels=batch["input_ids"]).last_hidden_state
    torch.testing.assert_close(encoded, model.get_encoder()(**batch).last_hidden_state)


def test_an_unknown_argument_is_named_and_nobody_blamed_for_it(tokenizer):
    # The caller may be the user, PEFT, a Trainer or transformers: the message names the argument, not a culprit.
    model = random_model(tokenizer)
    batch = tokenizer(["A dog runs."], return_tensors="pt")
    with pytest.raises(TypeError) as refused:
        model(**batch, decoder_input_ids=batch["input_ids"][:, :1], prompt_ids=None)
    message = str(refused.value)
    assert "`prompt_ids`" in message and "leave it out" in message
    assert "transformers" not in message and "cache" not in message and "\n" not in message


def test_forward_refuses_the_cache_under_both_names_at_once(tokenizer, test_sentences):
    model = random_model(tokenizer)
    batch = tokenizer(test_sentences[0][:2], padding=True, return_tensors="pt")
    with pytest.raises(TypeError, match="not both"):
        model(**batch, decoder_input_ids=batch["input_ids"][:, :1], cache=object(), past_key_values=object())


def test_generate_decodes_with_the_cache_the_running_release_passes(tokenizer, test_sentences):
    # Greedy search through transformers' own loop: every step must see the cache, whatever its name, or the
    # output differs from decoding each step with the whole prefix.
    model = random_model(tokenizer).eval()
    batch = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    cached = model.generate(**batch, num_beams=1, max_new_tokens=12, use_cache=True)
    uncached = model.generate(**batch, num_beams=1, max_new_tokens=12, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("release", ["0.1", "0.2"])
def test_a_model_saved_by_an_earlier_release_translates_as_it_did_with_and_without_the_package(
    multi30k_dir, tmp_path, release
):
    saved = FIXTURES / f"saved_model_{release}"
    expected = (saved / "expected.de").read_text(encoding="utf-8").splitlines()
    sources = (multi30k_dir / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()[: len(expected)]
    assert translate_with_package(saved, sources) == expected
    without = translate_without_package(saved, sources, tmp_path)
    assert without["generate"] == without["pipeline"] == expected


@needs_other_end
def test_saved_under_this_end_translates_the_same_without_the_package_under_the_other(trained_model_dir, tmp_path):
    sources = ["A man is riding a bicycle down the street.", "Two dogs play in the snow.", "A girl sings."]
    expected = translate_with_package(trained_model_dir, sources)
    without = translate_without_package(trained_model_dir, sources, tmp_path, python=OTHER_END)
    assert without["generate"] == without["pipeline"] == expected


@needs_other_end
def test_saved_under_the_other_end_translates_the_same_without_the_package_under_this(trained_model_dir, tmp_path):
    saved = tmp_path / "saved"
    resave = (
        "import sys, vaswani_transformer\nfrom transformers import AutoModelForSeq2SeqLM, AutoTokenizer\n"
        "for auto in (AutoModelForSeq2SeqLM, AutoTokenizer):\n"
        "    auto.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])"
    )
    subprocess.run([OTHER_END, "-c", resave, str(trained_model_dir), str(saved)], check=True, cwd=tmp_path)
    sources = ["A man is riding a bicycle down the street.", "Two dogs play in the snow.", "A girl sings."]
    without = translate_without_package(saved, sources, tmp_path)
    assert without["generate"] == without["pipeline"] == translate_with_package(trained_model_dir, sources)


def test_names_transformers_does_not_publish_are_imported_by_compat_vaswani_alone():
    unpublished = ("transformers.utils.generic", "transformers.utils.output_capturing", "transformers.models.")
    unpublished += ("transformers.tokenization_utils_base", "transformers.masking_utils import create_causal_mask")
    for module in MODEL_DIR.glob("*.py"):
        if module.name != "compat_vaswani.py":
            text = module.read_text(encoding="utf-8")
            assert not [name for name in unpublished if f"from {name}" in text], module.name
    for name in ("_prepare_generation_config", "_get_default_generation_params"):
        users = [m.name for m in MODEL_DIR.glob("*.py") if name in m.read_text("utf-8")]
        assert users == ["compat_vaswani.py"], (name, users)


def _dotted_names(tree: ast.AST) -> list[str]:
    # Every whole `a.b.c` attribute chain and every `from a.b import c` of a module, as dotted names.
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                names.append(".".join([value.id, *reversed(parts)]))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return sorted({name for name in names if not any(other.startswith(f"{name}.") for other in names)})


def _private_torch_names(source: str) -> list[str]:
    # `torch._C...`, `torch.ops...`, `F._x`: a name under torch with a private part, or one of its operator libraries.
    private = []
    for name in _dotted_names(ast.parse(source)):
        parts = name.split(".")
        if parts[0] in ("torch", "F", "nn") and (
            parts[1:2] == ["ops"] or any(p.startswith("_") and not p.startswith("__") for p in parts[1:])
        ):
            private.append(name)
    return private


def test_the_model_folder_calls_no_private_torch_api():
    # The code saved with every model runs on torch releases this package has never seen: public names only.
    assert _private_torch_names("torch._C._len_torch_dispatch_stack()\nx = torch.ops.mkldnn.op") == [
        "torch._C._len_torch_dispatch_stack",
        "torch.ops.mkldnn.op",
    ]
    private = {
        module.name: names
        for module in sorted(MODEL_DIR.glob("*.py"))
        if (names := _private_torch_names(module.read_text(encoding="utf-8")))
    }
    assert not private, private
