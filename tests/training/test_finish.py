"""The end of a run: the averaged model (§6.1), its decoding chosen on the validation set, the translator saved."""

import json

import pytest
from conftest import mini_run


def test_decoding_is_chosen_on_the_whole_validation_set_and_recorded(mini_corpus, tmp_path):
    from vaswani_transformer.inference.engines import load_translator
    from vaswani_transformer.inference.translation import corpus_bleu, translate
    from vaswani_transformer.training.run import train

    config = mini_run(
        mini_corpus, tmp_path / "run", max_steps=30, choose_num_beams=[1, 3], choose_length_penalty=[0.0, 2.0]
    )
    output = train(config)
    choice = json.loads((output / "training_config.json").read_text())["decoding_choice"]
    tried = choice["tried"]
    assert [(t["num_beams"], t["length_penalty"]) for t in tried] == [(1, None), (3, 0.0), (3, 2.0)]
    assert choice["bleu"] == max(t["bleu"] for t in tried) and choice["sentences"] == 100
    generation = json.loads((output / "generation_config.json").read_text())
    assert generation["num_beams"] == choice["num_beams"]
    assert generation.get("length_penalty", 1.0) == (choice["length_penalty"] or 1.0)
    # The recorded score is the saved model's, with its saved decoding, on the validation set.
    model, tokenizer = load_translator(str(output), "cpu")
    sources = (mini_corpus / "val.en").read_text(encoding="utf-8").splitlines()
    references = (mini_corpus / "val.de").read_text(encoding="utf-8").splitlines()
    assert round(corpus_bleu(translate(model, tokenizer, sources), references)["score"], 2) == choice["bleu"]
    assert (
        f"the best of 3 settings by sacreBLEU on 100 validation sentences ({choice['bleu']})"
        in (output / "README.md").read_text()
    )


@pytest.mark.parametrize("damage", ['{"source_lang": "en", "targ', "[]", None], ids=["cut off", "no object", "deleted"])
def test_a_training_config_damaged_during_the_run_does_not_cost_the_averaged_model(
    mini_corpus, tmp_path, monkeypatch, damage
):
    # The decoding choice is added to training_config.json after training: a file cut off or deleted in the
    # meantime is rewritten from the run's settings, and the averaged model is saved all the same.
    from vaswani_transformer.training import finish as finishing
    from vaswani_transformer.training import run as training

    finish = finishing.Finisher.finish

    def finish_after_damage(finisher):
        record = finisher.output_dir / "training_config.json"
        record.write_text(damage) if damage is not None else record.unlink()
        return finish(finisher)

    monkeypatch.setattr(finishing.Finisher, "finish", finish_after_damage)
    output = training.train(mini_run(mini_corpus, tmp_path / "run", max_steps=6, choose_num_beams=[1, 2]))
    recorded = json.loads((output / "training_config.json").read_text())
    assert recorded["target_lang"] == "de" and recorded["max_steps"] == 6
    assert [t["num_beams"] for t in recorded["decoding_choice"]["tried"]] == [1, 2]
    assert (output / "model.safetensors").is_file() and (output / "generation_config.json").is_file()
