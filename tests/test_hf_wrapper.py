"""The Hugging Face remote-code wrapper (export/hf): a package written by hand as the export step
writes it loads through `Auto*.from_pretrained(dir, trust_remote_code=True)` in a fresh process
whose only model code is the package's (the repository and DeepSpeed are blocked there), and
matches our GPT: weights bit for bit, logits, greedy tokens, tokenizer.

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_hf_wrapper.py
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import ROOT, child_env, model_config
from safetensors.torch import save_file
from transformers import GenerationConfig
from transformers.dynamic_module_utils import get_imports, get_relative_imports

from export.hf.configuration_moe_pipeline import MoEPipelineConfig, auto_map, hf_config_dict
from pipeline.data import gpt2_tokenizer
from pipeline.model import GPT, init_weights

HF_DIR = ROOT / "export" / "hf"
QUANTIZE_SOURCE = ROOT / "pipeline" / "quantize.py"
EOS = 50256  # GPT-2's <|endoftext|>: bos, eos and pad of the package
PROMPTS = ["And God said", "In the beginning"]  # 3 GPT-2 tokens each: a batch without padding
NEW = 8


def tiny_config():
    # GPT-2's vocabulary so the real tokenizer's ids fit; init_std 0.1 so greedy tokens vary
    return model_config(vocab_size=50257, init_std=0.1)


def write_package(path: Path, model: GPT, dtype: torch.dtype = torch.float32) -> Path:
    """A package directory as export/package.py writes it (weights cast to `dtype`, routers in fp32)."""
    path.mkdir(parents=True)
    cfg = model.cfg
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        tensors[name] = t.detach().to(torch.float32 if name.endswith("gate.wg.weight") else dtype).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    dtype_name = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype_name, EOS, EOS), indent=2))
    GenerationConfig(bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS).save_pretrained(path)
    gpt2_tokenizer(cfg.seq_len).save_pretrained(path)
    shutil.copyfile(ROOT / "pipeline" / "model.py", path / "moe_model.py")
    shutil.copyfile(QUANTIZE_SOURCE, path / "moe_quantize.py")
    for name in ("configuration_moe_pipeline.py", "modeling_moe_pipeline.py"):
        shutil.copyfile(HF_DIR / name, path / name)
    return path


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread (and much faster than on threads competing for 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def greedy(model: GPT, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Our argmax loop (full forward each step), stopping a row at eos as `generate` does."""
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(new):
            nxt = model(ids).logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)  # finished rows get pad (= eos)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            done |= nxt == EOS
            if done.all():
                break
    return ids


# Runs in a fresh interpreter, cwd a temporary folder: only the packages' files provide model code.
LOADER = r'''
import json, logging, os, shutil, sys, warnings
for blocked in ("pipeline", "distill", "eval", "export", "deepspeed"):
    sys.modules[blocked] = None  # importing any of them now raises ImportError
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

fp32_dir, bf16_dir, out_path = sys.argv[1:4]
res = {}

class Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())

def error_of(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None

def load(path, **kw):
    grab = Grab()
    logging.getLogger("transformers").addHandler(grab)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, output_loading_info=True, **kw)
    logging.getLogger("transformers").removeHandler(grab)
    file = load_file(f"{path}/model.safetensors")
    sd = model.state_dict()
    return model, {
        "info": {k: sorted(map(str, v)) for k, v in info.items()},
        "warnings": grab.messages + [str(w.message) for w in caught],
        "names": sorted(sd), "file_names": sorted(file),
        "unequal": [k for k in file if sd[k].dtype != file[k].dtype or not torch.equal(sd[k], file[k])],
        "dtypes": {k: str(v.dtype) for k, v in sd.items()},
        "tied": model.lm_head.weight is model.wte.weight,
    }

config = AutoConfig.from_pretrained(fp32_dir, trust_remote_code=True)
res["config"] = {
    "class": type(config).__name__, "model_type": config.model_type,
    "model_config": config.to_model_config().to_dict(),
    "aliases": [config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                config.max_position_embeddings, config.tie_word_embeddings],
    "missing_error": error_of(lambda: type(config)().to_model_config()),
}
config.save_pretrained("resaved_config")
res["config"]["saved"] = json.load(open("resaved_config/config.json"))

model, res["fp32"] = load(fp32_dir)
gpt_module = sys.modules[type(model).__module__].GPT.__module__
res["fp32"]["code_files"] = [sys.modules[type(model).__module__].__file__, sys.modules[gpt_module].__file__]
res["fp32"]["training"] = model.training
res["fp32"]["generation_top_k"] = model.generation_config.top_k

tok = AutoTokenizer.from_pretrained(fp32_dir, trust_remote_code=True)
res["tokenizer_ids"] = [tok(p).input_ids for p in json.loads(sys.argv[4])]
res["tokenizer_ids_plain"] = AutoTokenizer.from_pretrained(fp32_dir)(json.loads(sys.argv[4])[0]).input_ids

enc = tok(json.loads(sys.argv[4]), return_tensors="pt")
ids = enc.input_ids[:1]
with torch.no_grad():
    res["logits"] = model(ids).logits
    res["loss"] = model(ids, labels=ids).loss
    first = model(ids[:, :2], use_cache=True)
    past = first.cache if hasattr(first, "cache") else first.past_key_values  # 5.17: past_key_values
    res["cached_last_logits"] = model(ids[:, 2:], past_key_values=past).logits[:, -1]
    kv = sys.modules[gpt_module].KVCache(config.to_model_config(), batch=1, max_len=config.seq_len)  # ours works too
    model(ids[:, :2], cache=kv)
    res["kv_cache_last_logits"] = model(ids[:, 2:], cache=kv).logits[:, -1]
new = int(sys.argv[5])
res["generate"] = model.generate(ids, max_new_tokens=new, do_sample=False)
res["generate_no_cache"] = model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=False)
res["generate_batch"] = model.generate(**enc, max_new_tokens=new, do_sample=False)
seq_len = config.seq_len
res["generate_full_context"] = model.generate(ids, max_new_tokens=seq_len - ids.shape[1], do_sample=False).shape
res["too_long_error"] = error_of(lambda: model.generate(ids, max_new_tokens=seq_len, do_sample=False))
padded_mask = torch.ones_like(enc.input_ids)
padded_mask[1, 0] = 0
res["padding_error"] = error_of(lambda: model.generate(enc.input_ids, attention_mask=padded_mask, max_new_tokens=2))

model.save_pretrained("resaved_model")
res["resaved_files"] = sorted(os.listdir("resaved_model"))
res["resaved_auto_map"] = json.load(open("resaved_model/config.json")).get("auto_map")
with torch.no_grad():
    res["resaved_logits"] = AutoModelForCausalLM.from_pretrained("resaved_model", trust_remote_code=True)(ids).logits

shutil.copytree(fp32_dir, "no_generation_config")
os.remove("no_generation_config/generation_config.json")
bare = AutoModelForCausalLM.from_pretrained("no_generation_config", trust_remote_code=True)
bare.generate(ids, max_new_tokens=1, do_sample=False)
res["no_generation_config_top_k"] = bare.generation_config.top_k

bf16, res["bf16"] = load(bf16_dir, dtype="auto")
res["bf16"]["generate"] = bf16.generate(ids, max_new_tokens=new, do_sample=False)
res["imported"] = sorted(n for n in ("pipeline", "distill", "eval", "export", "deepspeed") if sys.modules.get(n) is not None)
torch.save(res, out_path)
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Write an fp32 and a bf16 package, load both in a fresh process, return (its results, our GPT, our tokens)."""
    root = tmp_path_factory.mktemp("hf")
    cfg = tiny_config()
    model = GPT(cfg, moe_impl="reference").eval()
    init_weights(model, seed=0)
    fp32_dir = write_package(root / "fp32", model)
    bf16_dir = write_package(root / "bf16", model, torch.bfloat16)
    work = root / "cwd"
    work.mkdir()
    (work / "load.py").write_text(LOADER)
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(root / "hf_home"),  # a fresh dynamic-modules cache
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "load.py", str(fp32_dir), str(bf16_dir), str(work / "out.pt"),
                           json.dumps(PROMPTS), str(NEW)], cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(work / "out.pt", weights_only=False)
    tok = gpt2_tokenizer(cfg.seq_len)
    ids = torch.tensor([tok(p).input_ids for p in PROMPTS])
    with one_thread(), torch.no_grad():
        ours = {"logits": model(ids[:1]).logits, "greedy": greedy(model, ids, NEW)}
    return res, model, ids, ours


def test_remote_code_imports_only_torch_transformers_and_the_package():
    # what transformers' dynamic-module loader copies into its cache along with each file
    assert sorted(get_relative_imports(HF_DIR / "modeling_moe_pipeline.py")) == \
        ["configuration_moe_pipeline", "moe_model", "moe_quantize"]
    assert get_relative_imports(HF_DIR / "configuration_moe_pipeline.py") == ["moe_model"]
    for name in ("modeling_moe_pipeline.py", "configuration_moe_pipeline.py"):
        assert set(get_imports(HF_DIR / name)) <= {"dataclasses", "torch", "transformers"}, name
    assert get_relative_imports(QUANTIZE_SOURCE) == [] and set(get_imports(QUANTIZE_SOURCE)) <= {"__future__", "torch"}


def test_hf_config_dict_is_the_complete_config_json():
    cfg = tiny_config()
    d = hf_config_dict(cfg, "bfloat16", EOS, EOS)
    assert d["model_type"] == "moe_pipeline"
    assert d["architectures"] == ["MoEPipelineForCausalLM"]
    assert d["auto_map"] == auto_map() == {"AutoConfig": "configuration_moe_pipeline.MoEPipelineConfig",
                                           "AutoModelForCausalLM": "modeling_moe_pipeline.MoEPipelineForCausalLM"}
    assert d["dtype"] == "bfloat16" and "torch_dtype" not in d  # transformers 5 writes `dtype`
    assert d["transformers_version"] == transformers.__version__
    assert (d["bos_token_id"], d["eos_token_id"]) == (EOS, EOS)
    assert {k: d[k] for k in cfg.to_dict()} == cfg.to_dict()  # every ModelConfig field, under its own name
    config = MoEPipelineConfig(**d)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.max_position_embeddings,
            config.tie_word_embeddings) == (cfg.hidden, cfg.layers, cfg.heads, cfg.seq_len, cfg.tie_embeddings)


def test_autoconfig_loads_our_config(run):
    res, model, _, _ = run
    c = res["config"]
    assert (c["class"], c["model_type"]) == ("MoEPipelineConfig", "moe_pipeline")
    assert c["model_config"] == model.cfg.to_dict()
    cfg = model.cfg
    assert c["aliases"] == [cfg.hidden, cfg.layers, cfg.heads, cfg.seq_len, cfg.tie_embeddings]
    assert "lacks vocab_size" in c["missing_error"] and "hf_config_dict" in c["missing_error"]
    # hf_config_dict writes what save_pretrained writes (plus auto_map, which save_pretrained adds too)
    expected = hf_config_dict(cfg, "float32", EOS, EOS)
    assert c["saved"] == expected


def test_weights_load_unchanged_with_tied_head(run):
    res, model, _, _ = run
    r = res["fp32"]
    assert r["info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert r["warnings"] == []
    assert r["names"] == sorted(model.state_dict())  # exactly our GPT's names: no prefix
    assert r["file_names"] == sorted(set(model.state_dict()) - {"lm_head.weight"})
    assert r["unequal"] == [] and r["tied"]
    assert r["training"] is False
    # the MoE's top_k (experts per token) does not become sampling's top_k, with or without generation_config.json
    assert r["generation_top_k"] == res["no_generation_config_top_k"] == GenerationConfig().top_k != model.cfg.top_k
    # the model code came from the package (HF's modules cache), not from the repository
    assert all(str(ROOT / "pipeline") not in f and str(ROOT / "export") not in f for f in r["code_files"])
    assert res["imported"] == []


def test_logits_loss_and_cache_match_our_gpt(run):
    res, model, ids, ours = run
    ours = ours["logits"]
    torch.testing.assert_close(res["logits"], ours, atol=1e-5, rtol=1e-5)
    loss = F.cross_entropy(ours[0, :-1], ids[0, 1:])  # HF's causal-LM loss: shifted, mean
    torch.testing.assert_close(res["loss"], loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res["cached_last_logits"], ours[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res["kv_cache_last_logits"], ours[:, -1], atol=1e-5, rtol=1e-5)


def test_greedy_generate_matches_our_argmax_loop(run):
    res, model, ids, ours = run
    ours = ours["greedy"]
    assert res["generate"].tolist() == ours[:1].tolist()
    assert res["generate_no_cache"].tolist() == ours[:1].tolist()
    assert res["generate_batch"].tolist() == ours.tolist()  # equal-length prompts, no padding
    assert tuple(res["generate_full_context"]) == (1, model.cfg.seq_len)
    assert "exceeds the model's context of 32" in res["too_long_error"]
    assert "padding" in res["padding_error"]


def test_autotokenizer_encodes_like_ours(run):
    res, _, ids, _ = run
    assert res["tokenizer_ids"] == ids.tolist()
    assert res["tokenizer_ids_plain"] == ids[0].tolist()  # without trust_remote_code (stdin closed: no prompt)


def test_save_pretrained_writes_auto_map_and_the_code(run):
    res, _, _, _ = run
    assert res["resaved_auto_map"] == auto_map()
    assert {"config.json", "model.safetensors", "moe_model.py", "configuration_moe_pipeline.py",
            "modeling_moe_pipeline.py"} <= set(res["resaved_files"])
    assert torch.equal(res["resaved_logits"], res["logits"])


def test_bf16_package_keeps_the_gate_in_fp32(run):
    res, model, ids, _ = run
    r = res["bf16"]
    assert r["info"]["missing_keys"] == [] and r["info"]["unexpected_keys"] == [] and r["warnings"] == []
    assert r["unequal"] == []  # each tensor as stored: bf16, routers fp32
    gates = {k for k in r["dtypes"] if k.endswith("gate.wg.weight")}
    assert gates and all(r["dtypes"][k] == "torch.float32" for k in gates)
    assert {r["dtypes"][k] for k in r["dtypes"] if k not in gates} == {"torch.bfloat16"}
    out = r["generate"]
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + NEW
    assert out[0, :ids.shape[1]].tolist() == ids[0].tolist()


TOKENIZER_PROBE = r'''
import sys
from transformers import AutoTokenizer
for d in sys.argv[1:3]:
    for trust in (None, False):
        ids = AutoTokenizer.from_pretrained(d, trust_remote_code=trust)("In the beginning").input_ids
        print(f"\nRESULT {d} {trust} {ids}", flush=True)
'''

CUSTOM_CONFIG = '''
from transformers import PretrainedConfig


class SomeConfig(PretrainedConfig):
    model_type = "some_custom_model"
'''


def test_autotokenizer_asks_about_any_remote_code_model_and_false_is_the_quiet_workaround(tmp_path):
    """transformers 5's AutoTokenizer reads config.json through AutoConfig first, and AutoConfig asks before
    running the code an `auto_map` names, for our package as for any remote-code model (here a minimal one):
    nothing a package can write avoids that. `trust_remote_code=False` loads the tokenizer with no question
    and runs no package code (the package's README and ours say so)."""
    ours = write_package(tmp_path / "ours", GPT(tiny_config()).eval())
    other = tmp_path / "other"
    other.mkdir()
    (other / "custom_config.py").write_text(CUSTOM_CONFIG)
    (other / "config.json").write_text(json.dumps({"model_type": "some_custom_model",
                                                   "auto_map": {"AutoConfig": "custom_config.SomeConfig"}}))
    gpt2_tokenizer(64).save_pretrained(other)
    (tmp_path / "probe.py").write_text(TOKENIZER_PROBE)
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = subprocess.run([sys.executable, "probe.py", str(ours), str(other)], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    asked = "Do you wish to run the custom code?"
    blocks = proc.stdout.split("\nRESULT ")
    want = gpt2_tokenizer(64)("In the beginning").input_ids
    results = {}
    for before, line in zip(blocks, blocks[1:]):
        d, trust, ids = line.splitlines()[0].split(" ", 2)
        results[(Path(d).name, trust)] = (asked in before, json.loads(ids))
    assert results == {("ours", "None"): (True, want), ("ours", "False"): (False, want),
                       ("other", "None"): (True, want), ("other", "False"): (False, want)}
    assert not (tmp_path / "hf_home" / "modules").exists()  # no package code was imported
