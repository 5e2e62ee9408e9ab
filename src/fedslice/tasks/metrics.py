"""Generation metrics, called directly (``evaluate`` fetches its metric scripts from the hub and
fails offline).

* BLEU: sacrebleu's corpus BLEU against every reference of a prompt (multi-reference), 0-100.
* ROUGE-1/2/L: rouge-score F-measure (Porter stemming), the best over a prompt's references
  (``score_multi``), averaged over prompts, 0-100.

An empty generation is scored as empty (no match), never skipped.
"""

from __future__ import annotations

from collections.abc import Sequence


def bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    import sacrebleu

    width = max((len(r) for r in references), default=0)
    streams = [[refs[i] if i < len(refs) else None for refs in references] for i in range(width)]
    return float(sacrebleu.corpus_bleu(list(hypotheses), streams).score)


def rouge(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    from rouge_score import rouge_scorer

    kinds = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(kinds), use_stemmer=True)
    totals = dict.fromkeys(kinds, 0.0)
    for hyp, refs in zip(hypotheses, references):
        scores = scorer.score_multi(list(refs), hyp)
        for k in kinds:
            totals[k] += scores[k].fmeasure
    n = max(len(hypotheses), 1)
    return {k: 100.0 * v / n for k, v in totals.items()}


def generation_scores(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    return {"bleu": bleu(hypotheses, references), **rouge(hypotheses, references)}
