"""The data path: raw sources -> tokenized ArrayRecord shards (`train.data.prepare`, ``python -m train.data
prepare``) -> packed global batches read through Grain (`train.data.pipeline`), each process loading only the
rows its devices hold. `train.data.corpus` reads sources (text, folders, JSONL, Parquet, ``stdlib``)."""

from train.data.corpus import Document, corpus_files, default_cache_dir, read_documents
from train.data.pipeline import (
    FIELDS,
    Dataset,
    TrainBatches,
    check_source,
    context_permutation,
    load_dataset,
    local_rows,
    model_inputs,
    pack_windows,
    permute_length,
    to_global_arrays,
)

__all__ = [
    "FIELDS",
    "Dataset",
    "Document",
    "TrainBatches",
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
