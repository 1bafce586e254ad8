"""The data path: raw sources -> tokenized ArrayRecord shards (`train.data.prepare`, ``python -m train.data
prepare``, read back by `train.data.prepared`) -> packed global batches (`train.data.packing`) read through
Grain (`train.data.pipeline`), each process loading only the rows its devices hold. `train.data.corpus`
reads sources (text, folders, JSONL, Parquet, ``stdlib``); `train.data.chat` renders chat data with its
template and marks the assistant spans; `train.data.tokenizer` loads UTF-8 bytes or a ``tokenizer.json``."""

from train.data.corpus import Document, corpus_files, default_cache_dir, read_documents
from train.data.packing import FIELDS, context_permutation, model_inputs, pack_windows, permute_length
from train.data.pipeline import Dataset, TrainBatches, check_source, load_dataset, local_rows, to_global_arrays
from train.data.prepared import check_data_cache

__all__ = [
    "FIELDS",
    "Dataset",
    "Document",
    "TrainBatches",
    "check_data_cache",
    "check_source",
    "context_permutation",
    "corpus_files",
    "default_cache_dir",
    "load_dataset",
    "local_rows",
    "model_inputs",
    "pack_windows",
    "permute_length",
    "read_documents",
    "to_global_arrays",
]
