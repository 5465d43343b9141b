"""Peak host memory (issue 18.9): the corpus is tokenized in calls of bounded size."""

import datasets
import numpy as np

from llmforge.data.datamodule import tokenize_documents


class CountingTokenizer:
    """Bytes as ids; records the characters of each encode_batch call."""

    vocab_size, bos_id, eos_id = 258, 256, 257

    def __init__(self):
        self.calls = []

    def encode_batch(self, texts):
        self.calls.append(sum(map(len, texts)))
        return [list(t.encode()) for t in texts]


def test_tokenize_in_bounded_calls_gives_the_same_ids():
    texts = ["a" * 700, "b" * 300, "c" * 200, "d" * 2500, "", "e" * 10]
    ds = datasets.Dataset.from_dict({"text": texts})
    one, small = CountingTokenizer(), CountingTokenizer()
    whole = tokenize_documents(ds, one, max_chars=10**9)
    bounded = tokenize_documents(ds, small, max_chars=1000)
    assert one.calls == [3710]  # everything at once: the old peak
    # runs of <= 1000 chars; a longer text in pieces of <= 1000 (cut at whitespace where it has one, issue 26.4)
    assert small.calls == [1000, 200, 1000, 1000, 500, 10]
    np.testing.assert_array_equal(whole, bounded)
    assert bounded[0] == 256 and bounded[701] == 257 and len(bounded) == 3710 + 2 * 5
