"""sacreBLEU as an `evaluate` metric, loadable offline with `evaluate.load(path_to_this_file)`.

The Hub's "evaluate-metric/sacrebleu" script does the same; shipping this one lets evaluation
run without network access. Scores are corpus BLEU (Papineni et al., 2002) on detokenized text,
computed by `sacrebleu.corpus_bleu` with its defaults (13a tokenization, cased) unless told otherwise.
"""

import datasets
import evaluate
import sacrebleu


class Sacrebleu(evaluate.Metric):
    """Corpus BLEU with sacreBLEU; `compute(predictions, references, tokenize="13a", lowercase=False)`.

    Returns a dict with `score` (BLEU, 0 to 100), `counts`, `totals`, `precisions` (percent),
    `bp`, `sys_len`, `ref_len` and `signature` (sacreBLEU's reproducibility string).
    """

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="sacreBLEU corpus BLEU",
            citation="Post (2018), A Call for Clarity in Reporting BLEU Scores",
            inputs_description="predictions: list of str; references: list of list of str (one list per prediction)",
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
        )

    def _compute(self, predictions, references, tokenize: str = "13a", lowercase: bool = False) -> dict:
        counts = {len(refs) for refs in references}
        if len(counts) != 1:
            raise ValueError("sacreBLEU needs the same number of references for every prediction.")
        reference_streams = [list(stream) for stream in zip(*references, strict=True)]
        bleu = sacrebleu.BLEU(tokenize=tokenize, lowercase=lowercase)
        result = bleu.corpus_score(predictions, reference_streams)
        return {
            "score": result.score,
            "counts": result.counts,
            "totals": result.totals,
            "precisions": result.precisions,
            "bp": result.bp,
            "sys_len": result.sys_len,
            "ref_len": result.ref_len,
            "signature": str(bleu.get_signature()),
        }
