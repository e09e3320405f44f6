"""`ServeConfig`: every setting of `moe-pipeline serve`, validated once, frozen, passed whole.

    from export.serve.config import ServeConfig
    config = ServeConfig(package="runs/tiny/package", ep_size=2, placement="reactive")
    config.nproc            # 2: `--ep-size 2` alone means 2 ranks
    ServeConfig.from_flags({"package": ..., "replica_budget": -1})   # ServeConfigError naming --replica-budget

The CLI builds one from its flags (`moe-pipeline serve --help` lists them) and every layer below
(the server, the engine, the model builders) reads its fields; the defaults live here and nowhere
else. Checks that need the model (does --ep-size divide every layer's experts?) happen where the
package is loaded (export/inference.py) and name the same flags.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.schemes import SERVED

API_KEY_ENV = "MOE_PIPELINE_API_KEY"
PREDICTOR_CONFIG = "predictor.json"  # written by `moe-pipeline predictor train` (export/serve/placement/predictor.py)


class ServeConfigError(ValueError):
    """A serve setting that cannot work: the message names the flag and the fix."""


class ServeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    package: Path  # an exported package (moe-pipeline export)
    host: str = "127.0.0.1"  # this machine only, unless told otherwise
    port: int = Field(8000, ge=0, le=65535)  # 0: a free port
    # require 'Authorization: Bearer KEY': the key itself (library use), else read from $MOE_PIPELINE_API_KEY or
    # the file `api_key_file` names; never a command-line flag (it would show in `ps` on every rank)
    api_key: str | None = Field(None, repr=False)
    api_key_file: Path | None = None
    max_batch: int = Field(32, ge=1)  # sequences each rank decodes together
    # tokens each rank runs in a step (decode first, then prompt chunks): 512, where 2048 doubled the deep peer model's
    # time to first token at 32 concurrent for the same throughput (docs/serving.md, "Prefill and decode in one step")
    max_batched_tokens: int = Field(512, ge=1)
    max_prefill_seqs: int | None = Field(None, ge=1)  # prompts per prefill forward on a rank; None: all the step takes
    # KV cache (export/serve/kv_cache.py): GiB per rank (None: a share of the free memory), the longest sequence
    # (None: the model's context), tokens per block, sharing of prompt prefixes between requests
    kv_cache_memory: float | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=1, le=1024)
    prefix_caching: bool = True
    # the data-parallel path's expert exchange: auto (all-reduce through DeepSpeed's shared memory on one CPU machine,
    # else all-to-all), all-to-all (variable splits, DeepSpeed's comm), all-reduce
    expert_exchange: Literal["auto", "all-to-all", "all-reduce"] = "auto"
    max_waiting: int | None = Field(None, ge=1)  # sequences waiting for a slot before new ones get 429; None: 4 x max_batch
    max_prompts: int = Field(256, ge=1)  # prompts in one request (lm-eval's batched local-completions sends many)
    max_body_bytes: int = Field(1 << 20, ge=1)  # larger request bodies get 413
    nproc: int | None = Field(None, ge=1)  # ranks; None: the largest of ep_size and tp_size, else 1
    ep_size: int | None = Field(None, ge=1)  # expert-parallel degree; None: all ranks (at most a layer's experts)
    tp_size: int | None = Field(None, ge=1)  # tensor slicing of the dense part: 1 or nproc
    dtype: Literal["fp32", "bf16", "fp16"] | None = None  # None: the package's
    # quantisation at load (export/serve/kernels/swaps.py `quantize_linears`): weight-only int8, int4 (groups of 128
    # inputs; int8 where a row does not divide into them), w8a8 (int8 weights and each row of a linear's inputs rounded
    # to int8, vLLM's dynamic per-token W8A8; also on a package exported with --quantize int8), or None (the package's)
    quantize: Literal[SERVED] | None = None  # pipeline/schemes.py: the schemes serving quantises to
    quantize_head: bool = False  # the output layer too (its logits change; greedy rows through its own screen)
    # expert placement by a replica table: a policy of export/serve/placement/controller.py (`make_controller`)
    placement: Literal["none", "reactive", "predictive"] | None = None
    replica_budget: float = Field(0.25, ge=0)  # replicas a rank may hold, a fraction of its own expert memory
    resident_experts: float = Field(1.0, gt=0, le=1)  # fraction of a rank's experts in memory (the rest mapped)
    checksums: bool = True  # verify every file's sha256 before loading
    # the CPU kernels (export/serve/kernels/), what /health reports under "kernels": who runs a served model's linears
    # (kernel: our few-row kernel, oneDNN past it; onednn: oneDNN at every row count; aten: every layer as it is,
    # PyTorch's F.linear); greedy rows through the output layer's int8 screen (the same tokens, fewer bytes read); the
    # large weights moved into a file mapping (2 MB pages); the data-parallel ranks' sums through the kernel's
    # shared-memory reduce, which waits without spinning; the kernel's weight prefetch hint (auto: by CPU vendor); a
    # packed forward's rows of up to this many new tokens attending in the kernel (longer ones in SDPA); glibc malloc
    # tuned for many large short-lived tensors
    cpu_linears: Literal["kernel", "onednn", "aten"] = "kernel"
    head_screen: bool = True
    map_weights: bool = True
    local_reduce: bool = True
    prefetch: Literal["auto", "t0", "nta"] = "auto"
    attention_kernel_rows: int = Field(128, ge=0)
    malloc_tuning: bool = True
    smoke: str | None = None  # serve, send this one prompt over HTTP, print the answer, shut down

    @model_validator(mode="after")
    def _flags_agree(self) -> "ServeConfig":
        if self.nproc is None:  # `serve PKG --ep-size 2` means 2 ranks
            object.__setattr__(self, "nproc", max(self.ep_size or 1, self.tp_size or 1))
        if self.max_waiting is None:
            object.__setattr__(self, "max_waiting", 4 * self.max_batch)
        if self.api_key is None:
            object.__setattr__(self, "api_key", self._read_key())
        if self.max_batched_tokens < self.max_batch:
            raise ValueError(f"--max-batched-tokens {self.max_batched_tokens}: below --max-batch {self.max_batch} a "
                             f"step could have no room to start a sequence; give at least {self.max_batch}")
        if self.quantize is not None and ((self.tp_size or 1) > 1 or (self.ep_size or self.nproc) != self.nproc):
            raise ValueError(f"--quantize {self.quantize}: quantised weights run on the data-parallel layouts only (each rank "
                             f"all its experts' slices whole): drop --tp-size, and give --ep-size equal to the number "
                             f"of ranks ({self.nproc})")
        if self.quantize_head and self.quantize is None:
            raise ValueError("--quantize-head needs --quantize (int8 or int4; on a quantised package, its own scheme)")
        if self.placement is None and self.resident_experts != 1.0:
            raise ValueError("--resident-experts needs --placement (none, reactive or predictive)")
        if self.placement is not None:
            if (self.tp_size or 1) > 1:
                raise ValueError("--placement works with expert parallelism only: drop --tp-size")
            if (self.ep_size or self.nproc) != self.nproc:
                raise ValueError(f"--placement needs --ep-size equal to the number of ranks ({self.nproc}): "
                                 "replicas take the place of expert slicing")
        if self.placement == "predictive" and not (self.package / PREDICTOR_CONFIG).is_file():
            raise ValueError(f"--placement predictive: {self.package} has no predictor; run "
                             f"`moe-pipeline predictor train {self.package}` first")
        return self

    def _read_key(self) -> str | None:
        if self.api_key_file is not None:
            try:
                lines = self.api_key_file.read_text().splitlines()
                key = lines[0].strip() if lines else ""
            except OSError as err:
                raise ValueError(f"--api-key-file {self.api_key_file}: unreadable ({err.strerror})") from None
            if not key:
                raise ValueError(f"--api-key-file {self.api_key_file}: empty; write the key on its first line")
            return key
        return os.environ.get(API_KEY_ENV) or None

    @classmethod
    def from_flags(cls, values: dict) -> "ServeConfig":
        """Validate; a problem raises ServeConfigError with the flag's name (`--replica-budget: ...`)."""
        try:
            return cls(**values)
        except ValidationError as err:
            e = err.errors(include_url=False)[0]
            field = str(e["loc"][0]) if e["loc"] else ""
            message = e["msg"].removeprefix("Value error, ")
            if field:
                message = f"--{field.replace('_', '-')} {e.get('input')!r}: {message}"
            raise ServeConfigError(message) from None
