"""Learning BPE merges from a small corpus, deterministically.

`tokenizers`' BpeTrainer breaks ties between equally frequent pairs by token ids that depend on hash-map order,
so two runs on the same corpus can learn different merges; the tiny demo tokenizer must be reproducible (its ids
key caches and fixtures). This learner takes the most frequent pair and, among equals, the smallest pair in string
order. It is meant for corpora of a few thousand words (the built-in demo), not for training real vocabularies.
"""
from collections import Counter


def pretokenized_words(corpus, normalizer, pre_tokenizer, suffix):
    """Word -> count over `corpus`, each word a tuple of symbols after `normalizer` and `pre_tokenizer` (a
    tokenizers pipeline), the last symbol carrying the end-of-word `suffix`."""
    if isinstance(corpus, str) or not all(isinstance(t, str) for t in corpus):
        raise TypeError("corpus must be a list of str")
    counts = Counter()
    for text in corpus:
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)):
            counts[word] += 1
    return {(*word[:-1], word[-1] + suffix): n for word, n in counts.items() if word}


def _merge(word, pair, joined):
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def learn_bpe_merges(words, num_merges, min_frequency=2):
    """Up to `num_merges` merges (pairs of symbols), most frequent first; stops when no pair occurs
    `min_frequency` times."""
    words = dict(words)
    merges = []
    while len(merges) < num_merges:
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < min_frequency:
            break
        merges.append(best)
        joined = best[0] + best[1]
        merged = Counter()
        for word, n in words.items():
            merged[_merge(word, best, joined) if best[0] in word else word] += n
        words = merged
    return merges
