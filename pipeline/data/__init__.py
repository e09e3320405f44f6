"""Training text for the pipeline: corpus, document-level split, tokenizer, packing, cache.

This package turns the ``data`` section of a recipe (``pipeline.recipe.DataSpec``) into
tokenized, packed training and validation streams:

1. ``sources``: ``iter_documents`` streams the corpus (``data.train``: the bundled
   public-domain text, a Hugging Face dataset, or local files) as ``Document``s, one at
   a time; ``split_documents`` holds out whole documents (books, plays, files) for
   validation, by the sha256 of their ids, and ``find_split`` finds the same split of a
   stream in bounded memory.
2. ``tokenizers``: ``build_tokenizer`` makes the tokenizer ``data.tokenizer`` names:
   GPT-2's BPE, a byte-level BPE trained on the training split, or a checkpoint's.
3. ``cache``: ``prepare_data`` tokenizes both splits into token shards under a cache
   directory keyed by everything that affects the tokens, streaming, in
   ``data.workers`` processes.
4. ``sampling``: ``PackedTokens`` cuts a split into ``seq_len`` blocks at read time and
   ``global_sample_ids`` orders them, epoch by epoch.

The names other modules use are importable from ``pipeline.data`` itself.

Run ``python -m pipeline.data`` to print a summary of the bundled corpus
(documents, characters and tokens per split; ``pipeline.data.summary``); ``--help``
lists the options. For a large corpus prepare the data before training
(``moe-pipeline prepare RECIPE``), so that the ranks do not wait at their first
barrier while one of them tokenizes.
"""

from pipeline.data.cache import (
    BATCH_CHARS,
    BATCH_DOCS,
    ENCODE_BATCH,
    FORMAT_VERSION,
    SHARD_TOKENS,
    PreparedData,
    cache_key,
    cache_key_inputs,
    encode_documents,
    prepare_data,
    token_dtype,
)
from pipeline.data.sampling import PackedTokens, global_sample_ids, unigram_entropy
from pipeline.data.sources import (
    BUNDLED_INSTALL_HINT,
    BUNDLED_PACKAGES,
    MIN_DOCUMENTS,
    PIECE_CHARS,
    SUPPORTED_SUFFIXES,
    Document,
    Split,
    _split_text,
    find_split,
    iter_documents,
    load_documents,
    split_documents,
)
from pipeline.data.summary import main
from pipeline.data.tokenizers import (
    EOD_TOKEN,
    GPT2_FILE_SHA256,
    TOKENIZER_FILES,
    build_tokenizer,
    checkpoint_tokenizer,
    gpt2_files_dir,
    gpt2_tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)
from pipeline.shards import TokenShards, document_ids

__all__ = [
    "BATCH_CHARS",
    "BATCH_DOCS",
    "BUNDLED_INSTALL_HINT",
    "BUNDLED_PACKAGES",
    "Document",
    "ENCODE_BATCH",
    "EOD_TOKEN",
    "FORMAT_VERSION",
    "GPT2_FILE_SHA256",
    "MIN_DOCUMENTS",
    "PIECE_CHARS",
    "PackedTokens",
    "PreparedData",
    "SHARD_TOKENS",
    "SUPPORTED_SUFFIXES",
    "Split",
    "TOKENIZER_FILES",
    "TokenShards",
    "build_tokenizer",
    "cache_key",
    "cache_key_inputs",
    "checkpoint_tokenizer",
    "document_ids",
    "encode_documents",
    "find_split",
    "global_sample_ids",
    "gpt2_files_dir",
    "gpt2_tokenizer",
    "iter_documents",
    "load_documents",
    "load_tokenizer",
    "main",
    "prepare_data",
    "save_tokenizer",
    "split_documents",
    "token_dtype",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
    "unigram_entropy",
]
