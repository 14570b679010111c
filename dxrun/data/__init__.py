"""Data sources, chosen by ``data.name``: ``markov`` (synthetic), ``text`` and ``tokens``; or
your own, ``data._target_``. Each gives this process's rows of any step's global batch by random
access, and a prefetching train iterator with a JSON-able state: pure functions of (seed, step),
whatever the mesh and the number of processes. ``has_eval`` says whether there is held-out data
(a validation split shorter than one window: none, and evaluation is off with one warning).

- ``markov.py``: the synthetic Markov language with its exact loss floor.
- ``corpus.py``: token corpora (text tokenized at start, or pre-tokenized ``.bin`` files).
- ``batches.py``: ``Data``, the Grain pipeline over a corpus, your own source's protocol.
- ``prepare.py``: ``python -m dxrun.data.prepare``, a text corpus tokenized once into files.
"""

from dxrun.data.batches import (
    SPLITS,
    Data,
    GrainBatches,
    build_data,
    build_source,
    checked_batch,
    local_batches,
    position,
)
from dxrun.data.corpus import (
    TokenFile,
    Tokenizer,
    encode_files,
    recorded_tokenizer,
    split,
    text_files,
)
from dxrun.data.markov import EVAL, MAX_TABLE_BYTES, TRAIN, MarkovSource, table_bytes

__all__ = ["EVAL", "MAX_TABLE_BYTES", "SPLITS", "TRAIN", "Data", "GrainBatches", "MarkovSource",
           "TokenFile", "Tokenizer", "build_data", "build_source", "checked_batch",
           "encode_files", "local_batches", "position", "recorded_tokenizer", "split",
           "table_bytes", "text_files"]
