"""Translating with a trained model and choosing its decoding on a development set (§6.1)."""

import html
import importlib.util
import logging
import math
import multiprocessing
import os
import re
import shutil
import sys
import time
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch
from conftest import Exploit, needs_fork, tag_with_process

from vaswani_transformer.cli import main
from vaswani_transformer.data.segmentation import word_spans
from vaswani_transformer.inference.engines import TorchEngine, load_translator
from vaswani_transformer.inference.glossary import Glossary
from vaswani_transformer.inference.translation import (
    choose_decoding,
    corpus_bleu,
    map_in_workers,
    translate,
    translate_stream,
    validation_bleu,
)


@pytest.fixture(scope="module")
def development_set(corpus):
    validation = corpus["validation"].select(range(48))
    return list(validation["en"]), list(validation["de"])


def test_choose_decoding_scores_every_pair_and_keeps_the_best(trained_model_dir, development_set):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources, references = development_set
    before = model.generation_config.to_dict()
    choice = choose_decoding(model, tokenizer, sources, references, num_beams=[1, 4], length_penalties=[0.6, 1.5])
    assert [(t["num_beams"], t["length_penalty"]) for t in choice["tried"]] == [(1, None), (4, 0.6), (4, 1.5)]
    assert choice["bleu"] == max(t["bleu"] for t in choice["tried"])
    # Each score is that decoding's sacreBLEU, and trying them leaves the model's own decoding alone.
    paper = next(t for t in choice["tried"] if (t["num_beams"], t["length_penalty"]) == (4, 0.6))
    assert round(corpus_bleu(translate(model, tokenizer, sources), references)["score"], 2) == paper["bleu"]
    assert model.generation_config.to_dict() == before


def test_corpus_bleu_is_sacrebleus_corpus_bleu(corpus):
    # Real references, and hypotheses that share some of their n-grams: each sentence cut by a third.
    import sacrebleu

    references = list(corpus["test_2016_flickr"]["de"][:40])
    hypotheses = [" ".join(r.split()[: 2 * len(r.split()) // 3]) for r in references]
    for lowercase, tokenize in ((False, "13a"), (True, "intl")):
        expected = sacrebleu.corpus_bleu(hypotheses, [references], lowercase=lowercase, tokenize=tokenize).score
        ours = corpus_bleu(hypotheses, references, lowercase=lowercase, tokenize=tokenize)["score"]
        assert 0 < ours < 100 and ours == pytest.approx(expected, abs=1e-9)


def test_choose_decoding_refuses_nothing_to_choose_from(trained_model_dir, development_set):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    with pytest.raises(ValueError, match="at least one"):
        choose_decoding(model, tokenizer, *development_set, num_beams=[], length_penalties=[0.6])
    with pytest.raises(ValueError, match="num_beams must be at least 1"):
        choose_decoding(model, tokenizer, *development_set, num_beams=[4, 0], length_penalties=[0.6])


def test_validation_bleu_scores_beam_search_and_always_leaves_the_model_training(
    trained_model_dir, development_set, monkeypatch
):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources, references = development_set
    expected = round(corpus_bleu(translate(model, tokenizer, sources), references)["score"], 2)
    model.train()
    assert validation_bleu(model, tokenizer, sources, references) == expected
    assert model.training
    # A validation that fails (here: generation out of memory) must not leave the run training without dropout.
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        validation_bleu(model, tokenizer, sources, references)
    assert model.training


def test_translate_refuses_one_string_for_a_list_of_sentences(trained_model_dir):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    with pytest.raises(TypeError, match=r"translate\(model, tokenizer, \[sentence\]\)"):
        translate(model, tokenizer, "A dog runs.")
    with pytest.raises(TypeError, match="lines of text"):
        next(translate_stream(model, tokenizer, "A dog runs."))


def test_an_html_document_is_translated_as_one_text_with_its_markup_kept(trained_model_dir, corpus):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    first, second = corpus["test_2016_flickr"]["en"][:2]
    alone = translate(model, tokenizer, [first, second], split_sentences=False)
    page = f'<p class="x">{first}\n{second}</p>\n<script>var s = "{first}";</script>\n'
    escaped = [html.escape(translation, quote=False) for translation in alone]
    assert translate(model, tokenizer, [page], text_format="html") == [
        f'<p class="x">{escaped[0]} {escaped[1]}</p>\n<script>var s = "{first}";</script>\n'
    ]
    # A sentence over the model's limit is named by its place in the document, which is one text.
    too_long = "".join(chr(0x4E00 + i) for i in range(300))
    with pytest.raises(ValueError, match="^Sentence 2 of HTML text 1 has"):
        translate(model, tokenizer, [f"<p>{first}</p><p>{too_long}</p>"], text_format="html")
    with pytest.raises(ValueError, match="text_format must be 'text' or 'html', got 'pdf'"):
        translate(model, tokenizer, [page], text_format="pdf")


def test_threads_sharing_a_tokenizer_encode_with_their_own_settings(trained_model_dir, corpus, monkeypatch):
    # A fast tokenizer's call sets padding and truncation on its shared backend, then encodes. Thread A's padded
    # batch is held between the two; thread B's length check (no padding) may then change the settings only if
    # nothing keeps it out: A would encode unpadded rows of different lengths and fail to make a tensor.
    import threading

    from transformers.utils import PaddingStrategy

    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sentences = list(corpus["test_2016_flickr"]["en"][:2])
    assert len(tokenizer(sentences[0])["input_ids"]) != len(tokenizer(sentences[1])["input_ids"])
    settings, a_has_set, b_has_set = tokenizer.set_truncation_and_padding, threading.Event(), threading.Event()

    def set_and_hold(padding_strategy, *args, **kwargs):
        settings(padding_strategy, *args, **kwargs)
        padded = padding_strategy != PaddingStrategy.DO_NOT_PAD
        if threading.current_thread().name == "A" and padded and not a_has_set.is_set():
            a_has_set.set()
            b_has_set.wait(timeout=2)  # B sets its own only once A's call is done, where a lock keeps it out
        elif threading.current_thread().name == "B" and not padded:
            b_has_set.set()

    monkeypatch.setattr(tokenizer, "set_truncation_and_padding", set_and_hold)
    results = {}

    def run(name: str, batch: list[str]) -> None:
        if name == "B":
            a_has_set.wait(timeout=60)
        try:
            results[name] = translate(model, tokenizer, batch, num_beams=1, max_new_tokens=3)
        except Exception as error:  # what the other thread did to this one's call
            results[name] = error

    threads = [
        threading.Thread(target=run, args=args, name=args[0]) for args in (("A", sentences), ("B", [sentences[0]]))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    monkeypatch.undo()
    assert results == {
        "A": translate(model, tokenizer, sentences, num_beams=1, max_new_tokens=3),
        "B": translate(model, tokenizer, [sentences[0]], num_beams=1, max_new_tokens=3),
    }


@needs_fork
def test_worker_processes_translate_as_one_process_does(trained_model_dir, corpus, monkeypatch):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources = corpus["test_2016_flickr"]["en"][:40]
    sources = [*sources[:10], "", *sources[10:]]  # a blank line stays blank in its place
    expected = translate(model, tokenizer, sources, batch_size=8)
    streamed = list(translate_stream(model, tokenizer, sources, batch_size=8))
    assert expected[10] == "" and all(expected[:10])
    tag_with_process(monkeypatch)
    for translations, reference in (
        (translate(model, tokenizer, sources, batch_size=8, num_workers=2), expected),
        (list(translate_stream(model, tokenizer, sources, batch_size=8, num_workers=2)), streamed),
    ):
        workers = {t.split("|")[0] for t in translations if t}
        assert str(os.getpid()) not in workers and len(workers) == 2
        assert [t.split("|", 1)[-1] for t in translations] == reference


@needs_fork
def test_map_in_workers_keeps_the_order_in_processes_of_one_thread():
    def late_first(item):  # the first items take longest, so that they finish last
        time.sleep(0.02 * (12 - item))
        return item * item, os.getpid(), torch.get_num_threads()

    parent = os.getpid()
    results = list(map_in_workers(late_first, range(12), 2))
    assert [square for square, _, _ in results] == [item * item for item in range(12)]
    workers = {pid for _, pid, _ in results}
    assert parent not in workers and 1 <= len(workers) <= 2
    assert {threads for _, _, threads in results} == {1}
    assert list(map_in_workers(lambda item: (item, os.getpid()), range(3))) == [(0, parent), (1, parent), (2, parent)]
    # Left early, the iteration ends its workers.
    results = map_in_workers(late_first, range(12), 2)
    assert next(results)[0] == 0
    results.close()
    assert multiprocessing.active_children() == []


@needs_fork
def test_map_in_workers_yields_what_came_before_a_failure_and_never_waits_on_a_dead_worker():
    def items():
        yield from range(5)
        raise OSError("the input broke off")

    results = map_in_workers(lambda item: item + 1, items(), 2)
    assert [next(results) for _ in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(OSError, match="the input broke off"):
        next(results)

    def refuse_three(item):
        if item == 3:
            raise ValueError("three is refused")
        return item

    results = map_in_workers(refuse_three, range(8), 2)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="three is refused"):
        next(results)

    class TwoPartError(Exception):  # cannot be rebuilt from its pickle: Exception passes one argument back
        def __init__(self, first, second):
            super().__init__(f"{first} and {second}")

    def raise_two_parts(item):
        raise TwoPartError("this", "that")

    with pytest.raises(RuntimeError, match="TwoPartError: this and that"):
        list(map_in_workers(raise_two_parts, range(2), 2))
    # A worker that dies (killed for memory, say) fails the call instead of leaving it waiting forever.
    with pytest.raises(BrokenProcessPool):
        list(map_in_workers(lambda item: os._exit(1), range(4), 2))


def test_map_in_workers_refuses_where_it_cannot_fork_at_the_call(monkeypatch):
    with pytest.raises(ValueError, match="num_workers must be at least 1 process, got 0"):
        map_in_workers(abs, [1], 0)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ValueError, match="cannot do safely: use num_workers=1"):
        map_in_workers(abs, [1], 2)
    assert list(map_in_workers(abs, [-1, 2])) == [1, 2]  # one worker: computed here, anywhere
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ValueError, match="darwin cannot do safely"):
        map_in_workers(abs, [1], 2)


def test_non_blank_sentences_translated_to_nothing_are_counted_in_one_warning_per_call(
    trained_model_dir, corpus, caplog
):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources = corpus["test_2016_flickr"]["en"][:5]
    sources = [*sources[:2], "", *sources[2:]]  # a blank line translates to a blank line, and is no such case
    caplog.set_level(logging.WARNING, logger="vaswani_transformer.inference.translation")
    assert all(translate(model, tokenizer, sources[:2])) and not caplog.records  # the model's own decoding
    # A length penalty far below 0 favours the shortest hypotheses: beam search ends sentences at once.
    translations = translate(model, tokenizer, sources, batch_size=2, length_penalty=-100.0)
    empty = [number for number, (s, t) in enumerate(zip(sources, translations, strict=True), 1) if s and not t]
    assert len(empty) > 1  # the penalty must empty some for the check to mean anything
    expected = (
        f"{len(empty)} of 5 non-blank sentences translated to an empty string (sentence {', '.join(map(str, empty))})"
    )
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [expected]
    caplog.clear()
    assert list(translate_stream(model, tokenizer, sources, batch_size=2, length_penalty=-100.0)) == translations
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [expected]


def test_pytorch_weights_that_would_run_code_are_refused_in_one_line(trained_model_dir, tmp_path, capsys):
    # torch refuses the pickle (weights_only); what matters here is that the user reads one line, not 20.
    model = shutil.copytree(trained_model_dir, tmp_path / "model", ignore=shutil.ignore_patterns("checkpoints"))
    marker = tmp_path / "exploited"
    (model / "model.safetensors").unlink()
    torch.save({"model.shared.weight": Exploit(marker)}, model / "pytorch_model.bin")
    with pytest.raises(OSError, match=r"pytorch_model\*\.bin\) are a pickle of more than tensors"):
        load_translator(str(model), "cpu")
    (tmp_path / "in.en").write_text("A dog runs.\n")
    engines = ["torch"] + (["ctranslate2"] if importlib.util.find_spec("ctranslate2") else [])
    for engine in engines:
        arguments = ["--model", str(model), "--input", str(tmp_path / "in.en"), "--engine", engine]
        assert main(["translate", *arguments, "--ctranslate2-dir", str(tmp_path / "ct2")]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "model.safetensors, from a source you trust" in err, err
    assert not marker.exists()


def _block_texts(element) -> list[str]:
    # The text of each block of an lxml tree, in order: what a reader sees sentence by sentence.
    blocks = ("title", "h1", "p", "li", "td", "th", "div")
    return [" ".join("".join(e.itertext()).split()) for e in element.iter() if e.tag in blocks]


def test_a_page_with_nested_tags_links_lists_and_tables_comes_back_whole_and_valid(trained_model_dir, corpus):
    from lxml import etree

    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    s = corpus["test_2016_flickr"]["en"][:6]
    w = s[2].split()
    nested = f"{w[0]} <b>{w[1]} <i>{w[2]}</i> {' '.join(w[3:5])}</b> {' '.join(w[5:])}"
    page = (
        f"<html><head><title>{s[0]}</title></head><body>\n<h1>{s[1]}</h1>\n"
        f'<p>{nested} <a href="/next?page=2&amp;q=x" title="Next &quot;page&quot;" class="nav">{s[3]}</a></p>\n'
        f"<ul><li>{s[4]}</li><li><em>{s[5]}</em></li></ul>\n"
        f"<table><tr><td>{s[0]}</td><th>{s[1]}</th></tr></table></body></html>\n"
    )
    source = etree.fromstring(page)
    out = translate(model, tokenizer, [page], text_format="html")[0]
    translated = etree.fromstring(out)  # lxml's XML parser: well formed, every tag closed in its place
    # Every element as written, attributes and all, and no other; blocks where they were.
    assert sorted(etree.tostring(e, with_tail=False).split(b">")[0] for e in source.iter()) == sorted(
        etree.tostring(e, with_tail=False).split(b">")[0] for e in translated.iter()
    )
    assert [e.tag for e in translated.iter() if e.tag not in ("b", "i", "a", "em")] == [
        e.tag for e in source.iter() if e.tag not in ("b", "i", "a", "em")
    ]
    assert 'href="/next?page=2&amp;q=x" title="Next &quot;page&quot;" class="nav"' in out
    # Each block's text is its sentences' plain translations: the sentence across the tags, translated once.
    plain = translate(model, tokenizer, [" ".join(t.split()) for t in _block_texts(source)])
    assert _block_texts(translated) == [" ".join(t.split()) for t in plain]


def test_pre_code_translate_no_and_references_come_back_as_written(trained_model_dir, corpus):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    first, second = corpus["test_2016_flickr"]["en"][:2]
    page = (
        f"<pre>\n  {first}\n      {second}\n</pre>\n"
        "<p>Use <code>pip install torch</code> to install it.</p>\n"
        f'<p translate="no">{first}</p><div class="box notranslate"><p>{second}</p></div>\n'
        f"<p>{first.replace(' ', '&nbsp;', 1)}</p><table><tr><td>&nbsp;</td></tr></table>\n"
    )
    out = translate(model, tokenizer, [page], text_format="html")[0]
    t_first, t_second = (html.escape(t, quote=False) for t in translate(model, tokenizer, [first, second]))
    assert out.startswith(f"<pre>\n  {t_first}\n      {t_second}\n</pre>\n")  # lines and indentation kept
    assert out.count("<code>pip install torch</code>") == 1
    assert f'<p translate="no">{first}</p><div class="box notranslate"><p>{second}</p></div>' in out
    assert out.count("&nbsp;") == 2 and out.endswith("<table><tr><td>&nbsp;</td></tr></table>\n")


def test_a_run_on_sentence_over_the_limit_is_translated_clause_by_clause(trained_model_dir, corpus, monkeypatch):
    # Issue 74, case 14: `--long-inputs split` cut 32 clauses (1,467 characters) once, in the middle, into 2 pieces
    # of ~160 tokens that the model, which learnt sentences, translated as 2 short sentences.
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    plain = [s.rstrip(" .") for s in corpus["test_2016_flickr"]["en"] if not set(s) & set(",;:()[]\u2013\u2014")]
    clauses = [clause + "," for clause in plain[:31]] + [plain[31][0].lower() + plain[31][1:] + "."]
    sentence = " ".join(clauses)
    assert len(sentence) > 1400 and len(tokenizer(sentence)["input_ids"]) > tokenizer.model_max_length
    alone = translate(model, tokenizer, clauses, split_sentences=False)
    translated = []
    engine_translate = TorchEngine.translate

    def recorded(self, batch, glossary=None):
        translated.extend(batch)
        return engine_translate(self, batch, glossary)

    monkeypatch.setattr(TorchEngine, "translate", recorded)
    assert translate(model, tokenizer, [sentence], long_inputs="split") == [" ".join(t for t in alone if t)]
    assert sorted(translated) == sorted(clauses)  # 32 clauses in, each translated: 32 out


def test_alignments_of_a_text_are_its_sentences_laid_end_to_end(trained_model_dir, corpus):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    first, second = corpus["test_2016_flickr"]["en"][:2]
    (text,) = translate(model, tokenizer, [f"{first}  {second}"], alignments=True)
    alone = translate(model, tokenizer, [first, second], alignments=True)
    assert text.text == f"{alone[0].text}  {alone[1].text}"
    shift = (len(word_spans(first)), len(word_spans(alone[0].text)))
    assert text.alignment == alone[0].alignment + [(i + shift[0], j + shift[1]) for i, j in alone[1].alignment]
    with pytest.raises(ValueError, match="alignments count the words of text"):
        translate(model, tokenizer, ["<p>A dog.</p>"], text_format="html", alignments=True)


def test_a_glossary_puts_its_target_term_into_the_sentences_that_hold_its_source_term_and_no_other_changes(
    trained_model_dir, corpus
):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources = corpus["test_2016_flickr"]["en"][:60]
    glossary = Glossary([("woman", "Dame")])  # the model says "Frau": the term must come from the glossary
    holding = {i for i, source in enumerate(sources) if glossary.matches(source)}
    plain = translate(model, tokenizer, sources)
    with_terms = translate(model, tokenizer, sources, glossary=glossary)
    assert len(holding) >= 5 and not any(re.search(r"\bDame\b", plain[i]) for i in holding)
    assert all(re.search(r"\bDame\b", with_terms[i]) for i in holding)
    assert [t for i, t in enumerate(with_terms) if i not in holding] == [
        t for i, t in enumerate(plain) if i not in holding
    ]


def test_scores_give_each_text_the_mean_log_probability_of_its_tokens_over_its_sentences(trained_model_dir, corpus):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sentences = corpus["test_2016_flickr"]["en"][:40]
    short, long = min(sentences, key=len), max(sentences, key=len)
    texts = [short, "", f"{short} {long}"]
    scored = translate(model, tokenizer, texts, scores=True)
    assert [each.text for each in scored] == translate(model, tokenizer, texts)
    best = [found[0] for found in TorchEngine(model, tokenizer).scored_hypotheses([short, long])]
    tokens = [len(ids) for ids in tokenizer([h.text for h in best])["input_ids"]]  # </s> included, as scored
    assert tokens[0] != tokens[1] and best[0].confidence != best[1].confidence  # token-weighted differs from a mean
    assert scored[0].confidence == pytest.approx(best[0].confidence, rel=1e-4)
    assert scored[1].confidence is None  # a blank text: nothing was translated
    weighted = sum(h.confidence * n for h, n in zip(best, tokens, strict=True)) / sum(tokens)
    assert scored[2].confidence == pytest.approx(weighted, rel=1e-4)
    assert all(math.isfinite(each.confidence) and each.confidence <= 0 for each in (scored[0], scored[2]))


@needs_fork
def test_glossary_and_scores_come_back_the_same_from_worker_processes(trained_model_dir, corpus):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources = corpus["test_2016_flickr"]["en"][:24]
    options = {"glossary": Glossary([("woman", "Dame")]), "scores": True, "batch_size": 8}
    here = translate(model, tokenizer, sources, **options)
    there = translate(model, tokenizer, sources, num_workers=2, **options)
    assert [t.text for t in there] == [t.text for t in here]
    assert [t.confidence for t in there] == pytest.approx([t.confidence for t in here], rel=1e-4)
