"""The Hub both ways, offline: push a translator, a model and a corpus, then pull them back.

These tests use `tests/hub_server.py`, a small local stand-in for the Hugging Face Hub served on
127.0.0.1, in place of huggingface.co. The clients are the real, unpatched `huggingface_hub`,
`transformers` and `datasets`. `huggingface_hub` reads `HF_ENDPOINT` when it is imported, so every
client runs in a new Python process whose environment points at the local Hub, with its own empty
cache (`HF_HOME`) so that what it loads can only come from the Hub.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import LocalHub

import vaswani_transformer

TOKEN = "hf_local_test_token"
# The clients import the package this test process imports (not another installed copy).
PACKAGE_ROOT = str(Path(vaswani_transformer.__file__).resolve().parents[1])
SENTENCE = "A man is riding a bicycle down the street."
GERMAN = "Ein Mann fährt mit dem Fahrrad die Straße hinunter."
TRANSLATOR_FILES = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} | {
    path.name for path in (Path(vaswani_transformer.__file__).parent / "model").glob("*_vaswani.py")
}


@pytest.fixture
def hub(tmp_path):
    """A local Hub on a free port, storing its repositories under a temporary directory."""
    with LocalHub(tmp_path / "hub-storage", token=TOKEN) as server:
        yield server
    assert not server.errors, "the local hub failed:\n" + "\n".join(server.errors)


def run_client(hub: LocalHub, home: Path, *args: str, token: str = TOKEN, check: bool = True):
    """Run `python ARGS` against the local Hub with an empty Hugging Face cache in `home`; `check`: it must succeed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home),
        HF_HUB_CACHE=str(home / "hub"),
        HF_TOKEN=token,
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
    )
    home.mkdir(parents=True)
    result = subprocess.run([sys.executable, *args], env=env, cwd=home, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 or not check, (
        f"client failed ({result.returncode})\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}\n"
        f"requests the hub has no route for: {hub.unhandled}"
    )
    return result


def last_json_line(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def files_in(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_push_command_uploads_a_translator_that_loads_from_the_hub_with_auto_classes_and_pipeline(
    hub, trained_model_dir, tmp_path
):
    model_dir = shutil.copytree(trained_model_dir, tmp_path / "translator")  # `push` rewrites its README.md
    pushed = run_client(
        hub, tmp_path / "push", "-m", "vaswani_transformer.cli", "push", str(model_dir), "--repo-id", "org/translator"
    )
    assert f"{hub.url}/org/translator/commit/" in pushed.stdout  # the commit URL the Hub answered
    # No visibility asked for: the owner's default for new repositories (an organisation's may be private).
    assert "visibility" not in hub.created["org/translator"] and "private" not in hub.created["org/translator"]
    command = ["-m", "vaswani_transformer.cli", "push", str(model_dir), "--repo-id", "org/private", "--private"]
    run_client(hub, tmp_path / "push-private", *command)
    assert hub.created["org/private"]["visibility"] == "private"

    repo = hub.repo_dir("org/translator")
    assert TRANSLATOR_FILES <= files_in(repo), files_in(repo)
    for name in TRANSLATOR_FILES:
        assert (repo / name).read_bytes() == (model_dir / name).read_bytes(), name
    # The run's settings go without the paths of this machine: local paths by their last part, the rest as they were.
    local, uploaded = (json.loads((d / "training_config.json").read_text()) for d in (model_dir, repo))
    assert Path(local["data"]).is_absolute() and Path(local["output_dir"]).is_absolute()
    assert '"/' not in json.dumps(uploaded), uploaded  # no string of it starts with "/"
    assert uploaded["data"] == "multi30k" and uploaded["output_dir"] == Path(local["output_dir"]).name
    paths = ("data", "output_dir")
    assert {k: v for k, v in uploaded.items() if k not in paths} == {k: v for k, v in local.items() if k not in paths}

    script = f"""
import json
import vaswani_transformer
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

model = AutoModelForSeq2SeqLM.from_pretrained("org/translator")
tokenizer = AutoTokenizer.from_pretrained("org/translator")
ids = model.generate(**tokenizer([{SENTENCE!r}], return_tensors="pt"))
translator = pipeline("translation", model="org/translator", trust_remote_code=True)
local = AutoModelForSeq2SeqLM.from_pretrained({str(trained_model_dir)!r})
local_ids = local.generate(**tokenizer([{SENTENCE!r}], return_tensors="pt"))
print(json.dumps({{
    "class": type(model).__name__,
    "generate": tokenizer.decode(ids[0], skip_special_tokens=True),
    "pipeline": translator({SENTENCE!r})[0]["translation_text"],
    "local": tokenizer.decode(local_ids[0], skip_special_tokens=True),
}}))
"""
    loaded = last_json_line(run_client(hub, tmp_path / "load", "-c", script))
    assert loaded["class"] == "VaswaniForConditionalGeneration"
    assert loaded["generate"], loaded
    assert loaded["pipeline"] == loaded["generate"] == loaded["local"], loaded
    # The weights and the pipeline code came over HTTP from the local Hub into the empty cache.
    downloaded = [r for r in hub.requests if r.startswith("GET /org/translator/resolve/")]
    for name in ("model.safetensors", "tokenizer.json", "pipeline_vaswani.py"):
        assert any(r.endswith(f"/{name}") for r in downloaded), (name, downloaded)
    snapshots = tmp_path / "load" / "hub" / "models--org--translator" / "snapshots"
    assert [p.name for p in snapshots.glob("*/model.safetensors")], "model.safetensors not in the client's cache"


def test_model_and_tokenizer_push_to_hub_and_load_back_with_identical_logits(hub, trained_model_dir, tmp_path):
    push = f"""
import vaswani_transformer
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

path = {str(trained_model_dir)!r}
print(AutoModelForSeq2SeqLM.from_pretrained(path).push_to_hub("org/pushed"))
print(AutoTokenizer.from_pretrained(path).push_to_hub("org/pushed"))
"""
    run_client(hub, tmp_path / "push", "-c", push)
    assert hub.requests.count("POST /api/models/org/pushed/commit/main") == 2  # one commit each
    pushed = files_in(hub.repo_dir("org/pushed"))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md"} <= pushed

    load = f"""
import json
import torch
import vaswani_transformer
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

hub_model = AutoModelForSeq2SeqLM.from_pretrained("org/pushed")
hub_tokenizer = AutoTokenizer.from_pretrained("org/pushed")
path = {str(trained_model_dir)!r}
local_model, local_tokenizer = AutoModelForSeq2SeqLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
batch = hub_tokenizer([{SENTENCE!r}], text_target=[{GERMAN!r}], return_tensors="pt")
local_batch = local_tokenizer([{SENTENCE!r}], text_target=[{GERMAN!r}], return_tensors="pt")
with torch.no_grad():
    hub_logits, local_logits = hub_model(**batch).logits, local_model(**local_batch).logits
print(json.dumps({{
    "same_tokens": all(torch.equal(batch[k], local_batch[k]) for k in ("input_ids", "labels")),
    "shape": list(hub_logits.shape),
    "identical": torch.equal(hub_logits, local_logits),
    "max_difference": (hub_logits - local_logits).abs().max().item(),
}}))
"""
    result = last_json_line(run_client(hub, tmp_path / "load", "-c", load))
    assert result["same_tokens"], result
    assert result["shape"][0] == 1 and result["shape"][1] > 5, result
    assert result["identical"], result


def test_train_reads_a_parallel_corpus_uploaded_to_a_hub_dataset_repository(hub, multi30k_dir, tmp_path):
    corpus = tmp_path / "multi30k-mini"
    (corpus / "data").mkdir(parents=True)
    for split, stem, count in (("train", "train", 300), ("validation", "val", 60)):
        english = (multi30k_dir / f"{stem}.en").read_text(encoding="utf-8").splitlines()[:count]
        german = (multi30k_dir / f"{stem}.de").read_text(encoding="utf-8").splitlines()[:count]
        pairs = zip(english, german, strict=True)
        rows = [json.dumps({"translation": {"en": en, "de": de}}, ensure_ascii=False) for en, de in pairs]
        (corpus / "data" / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    (corpus / "README.md").write_text(
        "---\nlanguage: [en, de]\ntask_categories: [translation]\n---\n\nThe first Multi30k pairs, for tests.\n"
    )
    upload = f"""
from huggingface_hub import HfApi

api = HfApi()
api.create_repo("org/multi30k-mini", repo_type="dataset", exist_ok=True)
print(api.upload_folder(folder_path={str(corpus)!r}, repo_id="org/multi30k-mini", repo_type="dataset"))
"""
    run_client(hub, tmp_path / "upload", "-c", upload)
    assert files_in(hub.repo_dir("org/multi30k-mini", "dataset")) == {
        "README.md", "data/train.jsonl", "data/validation.jsonl"
    }  # fmt: skip

    output_dir = tmp_path / "trained"
    run_client(
        hub, tmp_path / "train", "-m", "vaswani_transformer.cli", "train", "--dataset", "org/multi30k-mini",
        "--source-lang", "en", "--target-lang", "de", "--output-dir", str(output_dir), "--preset", "small",
        "--model-option", "d_model=32", "--model-option", "d_ff=64", "--model-option", "encoder_layers=1",
        "--model-option", "decoder_layers=1", "--model-option", "num_attention_heads=2", "--vocab-size", "500",
        "--max-steps", "5", "--eval-steps", "5", "--save-steps", "5", "--average-last", "1", "--max-tokens", "512",
    )  # fmt: skip
    assert (output_dir / "config.json").is_file() and (output_dir / "model.safetensors").is_file()
    # Both splits came from the Hub: the train file was downloaded and validation was measured.
    downloaded = [r for r in hub.requests if r.startswith("GET /datasets/org/multi30k-mini/resolve/")]
    assert any(r.endswith("/data/train.jsonl") for r in downloaded), downloaded
    assert any(r.endswith("/data/validation.jsonl") for r in downloaded), downloaded
    log = [json.loads(line) for line in (output_dir / "training_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 5 and "validation_loss" in log[-1], log


def test_push_command_reports_a_refused_upload_as_an_error_not_a_traceback(hub, trained_model_dir, tmp_path):
    model_dir = shutil.copytree(trained_model_dir, tmp_path / "translator")
    card = model_dir / "README.md"
    card.write_text(card.read_text() + "\n## Notes\n\nWritten by hand.\n")
    card_before = card.read_text()
    result = run_client(
        hub, tmp_path / "push", "-m", "vaswani_transformer.cli", "push", str(model_dir), "--repo-id", "org/refused",
        token="hf_wrong_token", check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("vaswani-transformer push: error:") and "Traceback" not in result.stderr
    assert "org/refused" in result.stderr and "401" in result.stderr, result.stderr
    assert not hub.repo_dir("org/refused").exists()
    # A push that fails before anything is uploaded leaves the local card as it was (it is rewritten for the
    # repository only once that exists); so does an id that is none.
    assert card.read_text() == card_before
    result = run_client(
        hub, tmp_path / "push-bad-id", "-m", "vaswani_transformer.cli", "push", str(model_dir), "--repo-id", "bad id!!",
        check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr and "bad id!!" in result.stderr, result.stderr
    assert card.read_text() == card_before


def test_model_card_is_titled_by_the_model_and_says_truly_how_to_load_it(trained_model_dir, tmp_path):
    import re

    from huggingface_hub import EvalResult, ModelCard

    from vaswani_transformer.exchange.model_card import write_model_card

    model_dir = shutil.copytree(trained_model_dir, tmp_path / "model")
    signature = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1"
    result = EvalResult(
        task_type="translation", dataset_type="multi30k", dataset_name="multi30k", dataset_split="test_2016_flickr",
        metric_type="sacrebleu", metric_name="sacreBLEU", metric_value=31.5, metric_config=signature,
    )  # fmt: skip
    card = ModelCard.load(write_model_card(model_dir, "org/transformer-small-en-de", result))
    assert card.text.lstrip().startswith("# transformer-small-en-de\n")
    assert not [url for url in re.findall(r"https?://\S+", card.content) if "huggingface.co" not in url]
    assert 'from_pretrained("org/transformer-small-en-de", trust_remote_code=True)' in card.text
    assert 'pipeline("translation", model="org/transformer-small-en-de", trust_remote_code=True)' in card.text
    assert "import vaswani_transformer" in card.text
    index = card.data.to_dict()["model-index"][0]
    assert index["name"] == "transformer-small-en-de"
    flickr = [r for r in index["results"] if r["dataset"]["split"] == "test_2016_flickr"]
    metric = flickr[0]["metrics"][0]
    assert len(flickr) == 1 and (metric["type"], metric["value"], metric["config"]) == ("sacrebleu", 31.5, signature)
    # Without a Hub id, the directory names the model.
    card = ModelCard.load(write_model_card(model_dir)).text
    assert card.lstrip().startswith("# model\n")
    # A log that a killed run left with half a record at its end: the card reads the last whole one.
    with open(model_dir / "training_log.jsonl", "a", encoding="utf-8") as log:
        log.write('{"step": 99, "train_lo')
    assert ModelCard.load(write_model_card(model_dir)).text == card


def test_a_card_rewritten_without_the_run_settings_keeps_its_languages_and_dataset(trained_model_dir, tmp_path):
    # `evaluate` on a copy without training_config.json rewrites the card; `serve` still reads the languages there.
    from huggingface_hub import EvalResult, ModelCard

    from vaswani_transformer.exchange.model_card import write_model_card
    from vaswani_transformer.serving.app import model_languages

    model_dir = shutil.copytree(trained_model_dir, tmp_path / "model")
    (model_dir / "training_config.json").unlink()
    before = ModelCard.load(model_dir / "README.md").data
    result = EvalResult(
        task_type="translation", dataset_type="multi30k", dataset_name="multi30k", dataset_split="test_2016_flickr",
        metric_type="sacrebleu", metric_name="sacreBLEU", metric_value=31.5,
    )  # fmt: skip
    after = ModelCard.load(write_model_card(model_dir, eval_result=result)).data
    assert after.language == before.language == ["en", "de"] and after.datasets == before.datasets
    assert after.eval_results[-1].metric_value == 31.5
    assert model_languages(str(model_dir)) == ("en", "de")
    # A license the card names (an imported model's own, say) stays; the package's is only the default.
    assert after.license == "apache-2.0"
    card = ModelCard.load(model_dir / "README.md")
    card.data.license, card.data.license_name, card.data.license_link = "other", "opus-terms", "https://example.org"
    card.save(model_dir / "README.md")
    kept = ModelCard.load(write_model_card(model_dir)).data
    assert (kept.license, kept.license_name, kept.license_link) == ("other", "opus-terms", "https://example.org")
    # Metadata edited into something that is no YAML: one line naming the card, and the card left as it was.
    (model_dir / "README.md").write_text("---\nlanguage: [en, de\n---\nNotes.\n")
    with pytest.raises(ValueError, match=r"README.md has metadata that is no YAML \(.*\); fix its front matter"):
        write_model_card(model_dir)
    assert (model_dir / "README.md").read_text().endswith("Notes.\n")


def test_saved_weights_take_the_mode_the_umask_gives_every_other_file(tokenizer, tmp_path):
    # safetensors writes through a temporary file of mode 0600: others who may read the config could not load the model.
    import stat

    from conftest import random_model

    from vaswani_transformer.exchange.saving import save_translator

    umask = os.umask(0o027)
    try:
        saved = save_translator(random_model(tokenizer), tokenizer, tmp_path / "model")
    finally:
        os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in saved.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o640, modes
