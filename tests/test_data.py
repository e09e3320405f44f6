"""Tests for pipeline.data with real components: the installed corpus packages, GPT-2's
released BPE files, a real (small) BPE training run, real files on disk."""

from __future__ import annotations

import os

# Never touch the network: an hf: source must fail fast and clearly instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import importlib.util
import json
import math
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

from pipeline import data as D
from pipeline.shards import committed_parts


def make_cfg(**overrides) -> SimpleNamespace:
    values = dict(
        train="bundled",
        text_field="text",
        validation_fraction=0.05,
        tokenizer="bpe",
        vocab_size=512,
        seq_len=64,
        workers=0,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.fixture(scope="module")
def bundled() -> list[D.Document]:
    return D.load_documents(make_cfg())


@pytest.fixture(scope="module")
def small_corpus(bundled, tmp_path_factory) -> Path:
    """A handful of real documents as .txt files, cut short so BPE training is quick."""
    root = tmp_path_factory.mktemp("corpus")
    picks = ["kjv/Ruth", "kjv/Jonah", "kjv/Philemon", "kjv/Jude", "shakespeare/tragedies/macbeth"]
    by_id = {d.id: d for d in bundled}
    for doc_id in picks:
        name = doc_id.replace("/", "_") + ".txt"
        (root / name).write_text(by_id[doc_id].text[:30_000], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def gpt2() -> transformers.PreTrainedTokenizerFast:
    return D.gpt2_tokenizer(seq_len=128)


# --------------------------------------------------------------------------- corpus


def test_bundled_corpus_is_66_books_and_38_plays(bundled):
    ids = [d.id for d in bundled]
    assert len(ids) == len(set(ids)) == 104
    assert sum(i.startswith("kjv/") for i in ids) == 66
    assert sum(i.startswith("shakespeare/") for i in ids) == 38
    assert ids[0] == "kjv/Genesis" and ids[65] == "kjv/Revelation"
    assert "shakespeare/comedies/as-you-like-it" in ids
    genesis = bundled[0].text
    assert genesis.startswith("# Genesis\n\n## Chapter 1\n\nIn the beginning God created")
    assert "## Chapter 50" in genesis
    assert all(d.text.strip() for d in bundled)


def test_split_is_deterministic_disjoint_and_whole_documents(bundled):
    train, val = D.split_documents(bundled, 0.05)
    assert len(val) == max(1, round(0.05 * len(bundled))) == 5
    assert {d.id for d in train}.isdisjoint(d.id for d in val)
    assert len(train) + len(val) == len(bundled)
    # Whole documents, in the original order.
    order = {d.id: i for i, d in enumerate(bundled)}
    for split in (train, val):
        assert [order[d.id] for d in split] == sorted(order[d.id] for d in split)
        assert all(d in bundled for d in split)
    # Pinned: sha256 of ids, so the same on every machine and hash seed.
    assert [d.id for d in val] == [
        "kjv/Hosea", "kjv/Haggai", "kjv/Galatians", "kjv/James",
        "shakespeare/comedies/as-you-like-it",
    ]
    assert D.split_documents(list(bundled), 0.05) == (train, val)
    # Both sources on both sides once a larger fraction is held out.
    train3, val3 = D.split_documents(bundled, 0.3)
    for split in (train3, val3):
        assert {d.id.split("/")[0] for d in split} == {"kjv", "shakespeare"}


def test_split_rejects_bad_fraction(bundled):
    with pytest.raises(ValueError, match="data.validation_fraction"):
        D.split_documents(bundled, 0.5)


def test_local_txt_jsonl_parquet_and_globs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    for i in range(3):
        (tmp_path / "a" / f"doc{i}.txt").write_text(f"text file {i}\n", encoding="utf-8")
    rows = [{"text": f"json line {i}", "other": i} for i in range(10)]
    lines = [json.dumps(r) for r in rows]
    jsonl = "\n".join(lines[:5] + [""] + lines[5:]) + "\n"  # with a blank line
    (tmp_path / "b.jsonl").write_text(jsonl, encoding="utf-8")
    parquet_rows = pa.table({"text": [f"parquet row {i}" for i in range(8)]})
    pq.write_table(parquet_rows, tmp_path / "c.parquet")

    docs = D.load_documents(make_cfg(train=["a/*.txt", "b.jsonl", "c.parquet", "a/doc0.txt"]))
    ids = [d.id for d in docs]
    assert len(docs) == 3 + 10 + 8  # the repeated a/doc0.txt is read once
    assert ids[:4] == ["a/doc0.txt", "a/doc1.txt", "a/doc2.txt", "b.jsonl:1"]
    assert ids[-1] == "c.parquet:7"
    assert docs[0].text == "text file 0\n"
    assert docs[3 + 5].text == "json line 5"  # the blank line is skipped
    assert docs[-1].text == "parquet row 7"

    train, val = D.split_documents(docs, 0.2)
    assert len(val) == 4 and len(train) == 17


def test_few_documents_are_cut_at_blank_lines(tmp_path):
    paragraph = "word " * 2000  # 10,000 characters
    text = "\n\n".join(paragraph.strip() for _ in range(12))  # ~120,000 characters
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    docs = D.load_documents(make_cfg(train=str(tmp_path / "big.txt")))
    assert len(docs) == 3
    assert all(len(d.text) <= D.PIECE_CHARS for d in docs)
    assert [d.id.rsplit("#", 1)[1] for d in docs] == ["0", "1", "2"]
    assert "\n\n".join(d.text for d in docs) == text


def test_split_text_cuts_long_paragraphs():
    text = "\n".join(["x" * 90] * 30) + "\n\nshort"
    pieces = D._split_text(text, 1000)
    assert all(0 < len(p) <= 1000 for p in pieces)
    assert "".join(pieces).replace("\n", "") == text.replace("\n", "")


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ("missing.txt", "missing.txt"),
        ("notes.md", "unsupported"),
        ("nothing/*.txt", "matches no files"),
        (["ok.txt", "missing.jsonl"], "missing.jsonl"),
        ([], "empty"),
    ],
)
def test_bad_inputs_name_data_train(tmp_path, monkeypatch, train, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.md").write_text("hi", encoding="utf-8")
    (tmp_path / "ok.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(ValueError, match="data.train") as err:
        D.load_documents(make_cfg(train=train))
    assert message in str(err.value)


def test_missing_text_field_names_data_text_field(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    for name in ("a.jsonl", "b.parquet"):
        with pytest.raises(ValueError, match="data.text_field") as err:
            D.load_documents(make_cfg(train=str(tmp_path / name)))
        assert "'text'" in str(err.value) and "body" in str(err.value)


def test_hf_source_offline_fails_clearly():
    with pytest.raises(ValueError, match="data.train") as err:
        D.load_documents(make_cfg(train="hf:roneneldan/TinyStories"))
    assert "hf:roneneldan/TinyStories" in str(err.value)


# --------------------------------------------------------------------------- tokenizers


def test_gpt2_tokenizer_matches_gpt2(gpt2):
    assert len(gpt2) == 50257
    assert gpt2.convert_tokens_to_ids("<|endoftext|>") == 50256 == gpt2.eos_token_id
    assert gpt2("Hello world")["input_ids"] == [15496, 995]
    text = "To be, or not to be: that is the question.\n  Ünïcödé ✓"
    assert gpt2.decode(gpt2(text)["input_ids"]) == text


def test_gpt2_files_are_hash_checked(tmp_path):
    for name in D.GPT2_FILE_SHA256:
        shutil.copy(D.gpt2_files_dir() / name, tmp_path / name)
    D.gpt2_tokenizer(files_dir=tmp_path)  # an exact copy passes
    with (tmp_path / "vocab.bpe").open("a", encoding="utf-8") as f:
        f.write("x y\n")
    with pytest.raises(ValueError) as err:
        D.gpt2_tokenizer(files_dir=tmp_path)
    message = str(err.value)
    assert "vocab.bpe" in message and D.GPT2_FILE_SHA256["vocab.bpe"] in message
    assert "data.tokenizer" in message
    (tmp_path / "encoder.json").unlink()
    with pytest.raises(ValueError, match="encoder.json"):
        D.gpt2_tokenizer(files_dir=tmp_path)


def test_bpe_is_trained_deterministically(small_corpus):
    docs = D.load_documents(make_cfg(train=str(small_corpus / "*.txt")))
    first = D.train_bpe_tokenizer(docs, 512, seq_len=64)
    second = D.train_bpe_tokenizer(docs, 512, seq_len=64)
    assert len(first) == 512
    assert first.convert_tokens_to_ids("<|endoftext|>") == 0
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    text = "And the LORD spake unto Jonah — ünseen bytes ✓"
    assert first.decode(first(text)["input_ids"]) == text
    with pytest.raises(ValueError, match="data.vocab_size"):
        D.train_bpe_tokenizer(docs, 100)


def test_tokenizer_round_trip_through_autotokenizer(tmp_path, gpt2, small_corpus):
    docs = D.load_documents(make_cfg(train=str(small_corpus / "*.txt")))
    bpe = D.train_bpe_tokenizer(docs[:3], 300, seq_len=64)
    text = docs[-1].text[:2000]
    for name, tok in (("gpt2", gpt2), ("bpe", bpe)):
        D.save_tokenizer(tok, tmp_path / name)
        auto = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        loaded = D.load_tokenizer(tmp_path / name)
        expected = tok(text)["input_ids"]
        assert auto(text)["input_ids"] == expected == loaded(text)["input_ids"]
        assert auto.eos_token == "<|endoftext|>" and len(auto) == len(tok)


def test_load_tokenizer_names_missing_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json") as err:
        D.load_tokenizer(tmp_path)
    assert "moe-pipeline teacher" in str(err.value)


# --------------------------------------------------------------------------- cache


def test_a_checkpoints_tokenizer_frames_each_document_as_its_pretraining_did(tmp_path, small_corpus):
    """data.tokenizer a directory (a Hugging Face teacher's tokenizer.json): its BOS starts each document when its
    post-processor adds one (Llama, Mixtral), its end-of-sequence token ends it, once; the cache is keyed by the
    files' contents, not their path."""
    import shutil

    from tokenizers import processors

    docs = D.load_documents(make_cfg(train=str(small_corpus / "*.txt")))
    tok = D.train_bpe_tokenizer(docs, 400, 64)
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save_pretrained(str(tmp_path / "ckpt"))
    cfg = make_cfg(train=str(small_corpus / "*.txt"), validation_fraction=0.2, tokenizer=str(tmp_path / "ckpt"))
    data = D.prepare_data(cfg, tmp_path / "cache")
    assert data.eod_id == tok.eos_token_id == 0 and data.vocab_size == 401
    for name, tokens in (("train", data.train), ("val", data.val)):
        ids = np.asarray(tokens)
        docs_here = data.meta["splits"][name]["documents"]
        assert ids[0] == bos and int((ids == bos).sum()) == int((ids == 0).sum()) == docs_here
        assert (ids[1:][ids[:-1] == 0] == bos).all()  # every document after the first starts with BOS
    shutil.copytree(tmp_path / "ckpt", tmp_path / "moved")
    again = D.prepare_data(make_cfg(**{**vars(cfg), "tokenizer": str(tmp_path / "moved")}), tmp_path / "cache")
    assert again.cache_dir == data.cache_dir
    shutil.rmtree(tmp_path / "moved")
    with pytest.raises(ValueError, match="data.tokenizer=.*no tokenizer.json there"):
        D.prepare_data(make_cfg(**{**vars(cfg), "tokenizer": str(tmp_path / "moved")}), tmp_path / "cache")


def test_prepare_data_builds_then_reuses_cache(tmp_path, small_corpus):
    cfg = make_cfg(train=str(small_corpus / "*.txt"), validation_fraction=0.2)
    cache = tmp_path / "cache"
    data = D.prepare_data(cfg, cache)
    assert data.cache_dir.parent == cache and len(data.cache_dir.name) == 16
    assert sorted(p.name for p in cache.iterdir()) == [data.cache_dir.name]  # no temp dirs left
    assert data.vocab_size == len(data.tokenizer) == 512 == data.meta["vocab_size"]
    assert data.eod_id == 0 and data.train.dtype == np.uint16
    for name, tokens in (("train", data.train), ("val", data.val)):
        split = data.meta["splits"][name]
        assert split["tokens"] == len(tokens) and tokens[-1] == data.eod_id
        assert int((np.asarray(tokens) == data.eod_id).sum()) == split["documents"]
    # The same split as split_documents, its ids in each split's stream order.
    train_docs, val_docs = D.split_documents(D.load_documents(cfg), cfg.validation_fraction)
    assert list(D.document_ids(data.cache_dir, "train")) == [d.id for d in train_docs]
    assert list(D.document_ids(data.cache_dir, "val")) == [d.id for d in val_docs]
    # The first training document decodes back to its text.
    first_eod = int(np.argmax(np.asarray(data.train) == data.eod_id))
    assert data.tokenizer.decode(data.train[:first_eod].tolist()) == train_docs[0].text

    meta_file = data.cache_dir / "meta.json"
    mtime = meta_file.stat().st_mtime_ns
    again = D.prepare_data(make_cfg(**{**vars(cfg), "seq_len": 32}), cache)
    assert again.cache_dir == data.cache_dir and meta_file.stat().st_mtime_ns == mtime
    assert again.tokenizer.model_max_length == 32
    np.testing.assert_array_equal(again.train, data.train)
    np.testing.assert_array_equal(again.val, data.val)

    assert D.cache_key(make_cfg(**{**vars(cfg), "vocab_size": 600})) != D.cache_key(cfg)
    assert D.cache_key(make_cfg(**{**vars(cfg), "validation_fraction": 0.1})) != D.cache_key(cfg)


def test_cache_key_follows_file_changes(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n", encoding="utf-8")
    cfg = make_cfg(train=str(tmp_path / "*.txt"), tokenizer="gpt2")
    key = D.cache_key(cfg)
    assert D.cache_key(make_cfg(**{**vars(cfg), "vocab_size": 999})) == key  # unused by gpt2
    (tmp_path / "b.txt").write_text("three\n", encoding="utf-8")
    assert D.cache_key(cfg) != key


def test_concurrent_prepare_data_is_safe(tmp_path, small_corpus):
    cfg = make_cfg(train=str(small_corpus / "*.txt"), tokenizer="gpt2", validation_fraction=0.2)
    results: list[D.PreparedData] = []
    threads = [
        threading.Thread(target=lambda: results.append(D.prepare_data(cfg, tmp_path)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    assert [p.name for p in tmp_path.iterdir()] == [results[0].cache_dir.name]
    np.testing.assert_array_equal(results[0].train, results[1].train)
    assert results[0].eod_id == 50256 and results[0].vocab_size == 50257


# --------------------------------------------------------------------------- shards at scale


def test_token_shards_read_ranges_across_shard_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    sizes = [5, 0, 1, 17, 3, 0, 9]  # empty parts (a part with no held-out document) have no file
    flat = rng.integers(0, 60000, size=sum(sizes)).astype(np.uint16)
    files, start = [], 0
    for i, n in enumerate(sizes):
        files.append(tmp_path / f"train-{i:05d}.bin")
        if n:
            flat[start : start + n].tofile(files[-1])
        start += n
    shards = D.TokenShards(files, sizes, "uint16")
    assert len(shards) == flat.size and shards.dtype == np.uint16
    for a in range(flat.size + 1):
        for b in range(a, flat.size + 2):
            np.testing.assert_array_equal(shards[a:b], flat[a:b])
    assert [shards[i] for i in range(-3, 3)] == [flat[i] for i in range(-3, 3)]
    with pytest.raises(IndexError):
        shards[flat.size]
    np.testing.assert_array_equal(np.concatenate(list(shards.chunks(4))), flat)
    np.testing.assert_array_equal(np.asarray(shards), flat)
    packed, reference = D.PackedTokens(shards, 4, eod_id=0), D.PackedTokens(flat, 4, eod_id=0)
    ids = list(range(len(packed)))
    assert all(torch.equal(packed.batch(ids)[k], reference.batch(ids)[k]) for k in reference.batch(ids))
    files[3].write_bytes(b"\0" * 10)  # 5 tokens where 17 were written
    with pytest.raises(ValueError, match="train-00003.bin is damaged") as err:
        D.TokenShards(files, sizes, "uint16")
    assert "delete" in str(err.value)


def _verse_corpus(tmp_path: Path) -> Path:
    """The KJV's verses as a jsonl corpus of 31,103 small documents, read from the installed package."""
    verses = Path(importlib.util.find_spec("bible").origin).parent / "data" / "kjv.jsonl"
    path = tmp_path / "verses.jsonl"
    path.write_text(verses.read_text(encoding="utf-8"), encoding="utf-8")
    return path


def test_find_split_is_split_documents_in_bounded_memory(tmp_path):
    path = _verse_corpus(tmp_path)
    for fraction in (0.05, 0.3, 1e-6):  # 1e-6: the one document with the smallest hash
        cfg = make_cfg(train=str(path), validation_fraction=fraction)
        docs = D.load_documents(cfg)
        _, val = D.split_documents(docs, fraction)
        split = D.find_split(cfg, tmp_path / "digests")
        assert (split.documents, split.validation) == (len(docs), len(val))
        assert [d.id for d in docs if split.held_out(d.id)] == [d.id for d in val]
        assert not (tmp_path / "digests").exists()


@pytest.mark.slow
def test_shards_give_todays_blocks_on_the_bundled_corpus(tmp_path):
    """The tiny recipe's data (bundled corpus, bpe 8192): 2 worker processes writing ~100k-token shards give the
    tokens, and so every training and validation block, of the flat in-memory cache this replaced."""
    cfg = make_cfg(vocab_size=8192, seq_len=128, workers=2)
    data = D.prepare_data(cfg, tmp_path, shard_tokens=100_000)
    assert len(data.train.files) > 20  # many shards, so many blocks straddle two
    train_docs, val_docs = D.split_documents(D.load_documents(cfg), cfg.validation_fraction)
    tok = D.train_bpe_tokenizer(train_docs, 8192, 128)
    assert tok.get_vocab() == data.tokenizer.get_vocab()
    for docs, shards in ((train_docs, data.train), (val_docs, data.val)):
        flat = D.encode_documents(tok, docs, data.eod_id, np.dtype(np.uint16))
        new, old = D.PackedTokens(shards, 128, data.eod_id), D.PackedTokens(flat, 128, data.eod_id)
        assert len(new) == len(old)
        ids = list(range(len(old)))
        for key, value in old.batch(ids).items():
            assert torch.equal(new.batch(ids)[key], value), key
    assert data.meta["splits"]["train"]["tokens"] == len(data.train)


@pytest.mark.slow
def test_a_killed_preparation_resumes_after_its_last_part(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    corpus = _verse_corpus(tmp_path)
    cfg = make_cfg(train=str(corpus), vocab_size=300)
    root = tmp_path / "cache"
    cmd = [sys.executable, "-m", "pipeline.data", str(corpus), "--tokenizer", "bpe", "--vocab-size", "300",
           "--workers", "0", "--shard-tokens", "2000", "--cache-dir", str(root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    work = root / f".{D.cache_key(cfg)[:16]}.partial"
    deadline = time.monotonic() + 120
    while not (work / "part-00020.json").exists():
        assert proc.poll() is None, "the preparation ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = committed_parts(work)
    assert 20 < len(done) and not (work / "meta.json").exists()
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in work.glob("*-0000[0-9].*")}
    assert kept

    data = D.prepare_data(cfg, root, shard_tokens=2000)  # resumes
    assert sorted(p.name for p in root.iterdir()) == [data.cache_dir.name]
    assert {n: ((data.cache_dir / n).stat().st_ino, (data.cache_dir / n).stat().st_mtime_ns) for n in kept} == kept
    clean = D.prepare_data(cfg, tmp_path / "clean", shard_tokens=10**9)  # one part: the same tokens
    assert len(clean.train.files) == 1 and len(data.train.files) > 100
    for name in ("train", "val"):
        np.testing.assert_array_equal(np.asarray(getattr(data, name)), np.asarray(getattr(clean, name)))
        assert list(D.document_ids(data.cache_dir, name)) == list(D.document_ids(clean.cache_dir, name))
    assert data.meta["splits"]["train"]["documents"] + data.meta["splits"]["val"]["documents"] == 31103


# --------------------------------------------------------------------------- packing + sampling


def test_packed_tokens_blocks_labels_and_loss_mask():
    eod = 9
    tokens = np.array([1, 2, 3, eod, 4, 5, eod, 6, 7, 8, eod, 1, 2], dtype=np.uint16)
    packed = D.PackedTokens(tokens, seq_len=4, eod_id=eod)
    assert packed.num_blocks == len(packed) == 3  # (13 - 1) // 4
    batch = packed.batch([2, 0])
    assert set(batch) == {"input_ids", "labels", "loss_mask"}
    assert batch["input_ids"].shape == batch["labels"].shape == batch["loss_mask"].shape == (2, 4)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    # Block i reads tokens[4i : 4i + 5]: inputs the first four, labels shifted by one.
    assert batch["input_ids"].tolist() == [[7, 8, eod, 1], [1, 2, 3, eod]]
    assert batch["labels"].tolist() == [[8, eod, 1, 2], [2, 3, eod, 4]]
    # No loss for predicting the next document's first token from EOD.
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1], [1, 1, 1, 0]]
    with pytest.raises(IndexError):
        packed.batch([3])


def test_packed_tokens_too_short_names_seq_len():
    with pytest.raises(ValueError, match="data.seq_len") as err:
        D.PackedTokens(np.arange(10, dtype=np.uint16), seq_len=16, eod_id=0, name="val")
    assert "10 tokens" in str(err.value) and "val" in str(err.value)


def test_global_sample_ids_are_deterministic_epoch_permutations():
    n = 7
    ids = D.global_sample_ids(n, seed=1234, start=0, count=5 * n)
    assert ids.dtype == np.int64 and len(ids) == 5 * n
    for epoch in range(5):
        assert sorted(ids[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    assert not all(
        (ids[:n] == ids[e * n : (e + 1) * n]).all() for e in range(1, 5)
    )  # epochs are reshuffled
    np.testing.assert_array_equal(ids, D.global_sample_ids(n, 1234, 0, 5 * n))
    # Resuming from any global index gives the same stream.
    pieces = [D.global_sample_ids(n, 1234, s, c) for s, c in ((0, 3), (3, 10), (13, 22))]
    np.testing.assert_array_equal(np.concatenate(pieces), ids)
    assert not np.array_equal(D.global_sample_ids(n, 1235, 0, 5 * n), ids)
    assert len(D.global_sample_ids(n, 1, 100, 0)) == 0


def test_unigram_entropy():
    k = 37
    uniform = np.tile(np.arange(k, dtype=np.uint16), 5)
    assert math.isclose(D.unigram_entropy(uniform), math.log(k), rel_tol=1e-12)
    with_eod = np.concatenate([uniform, np.full(50, 99, dtype=np.uint16)])
    assert math.isclose(D.unigram_entropy(with_eod, eod_id=99), math.log(k), rel_tol=1e-12)
    assert D.unigram_entropy(np.array([5, 5, 5])) == 0.0


def test_cli_summary(small_corpus, capsys):
    assert D.main([str(small_corpus / "*.txt"), "--tokenizer", "bpe", "--vocab-size", "400"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "val" in out and "vocab 400" in out
    with pytest.raises(SystemExit) as exit_info:
        D.main([str(small_corpus / "missing.txt")])
    assert exit_info.value.code == 2


def test_cli_prepare_fills_the_cache_teacher_reads(tmp_path, data_cache):
    from conftest import cli, sets

    proc = cli("prepare", "recipes/tiny.yaml")
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"[prepare] {data_cache}/"), line
    cache_dir = Path(line.split()[1].rstrip(":"))
    meta = json.loads((cache_dir / "meta.json").read_text())
    assert f"train {meta['splits']['train']['tokens']:,} tokens" in line
    assert (cache_dir / "train-00000.bin").stat().st_size == 2 * meta["splits"]["train"]["tokens"]
    bad = cli("prepare", "recipes/tiny.yaml", *sets(f"data.train={tmp_path}/none/*.txt"), check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("recipe error: data.train: the pattern")
