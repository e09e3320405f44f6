"""Recipes: one YAML file per experiment, validated into frozen, typed config objects.

A recipe names everything a run needs: data, the teacher's architecture, how teacher and student
train, and how many ranks run it. Defaults live here and nowhere else; an unknown key, a wrong
type, an out-of-range value or an inconsistent combination raises `RecipeError`, whose one-line
message names the key path, the value and what was expected (the CLI prints it and exits 2).
Rules across fields are pydantic model validators on the section they involve (on `Recipe` when
they span sections); those that depend on the world size read it from the validation context,
`Recipe.model_validate(raw, context={"world_size": N})`, which `validate` and `load_recipe` pass.
Validators do no file I/O: what they need from files (a Hugging Face teacher's config.json, whether a
tokenizer directory holds a tokenizer.json) is read once before validation (`read_teacher_files`) and
handed to them in the same context; the recipe keeps the teacher's config (`Recipe.hf_teacher`).

    python -m pipeline.recipe recipes/tiny.yaml --set teacher.train.steps=50   # print the resolved recipe
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

# GPT-2's 50,257 entries padded to 50,304, as Megatron's make-vocab-size-divisible-by 128 does:
# matmuls over a multiple of 128 are faster, and the paper's parameter counts assume it.
VOCAB_MULTIPLE = 128
GPT2_VOCAB = 50257


class RecipeError(ValueError):
    """A recipe problem: the key path, the value found and what was expected.

    Validators raise it with the key's full path; pydantic wraps it (it is a ValueError) and
    `_first_error` unwraps it again, so the message is the same as raised.
    """

    def __init__(self, path: str, value: Any, expected: str):
        self.path, self.value, self.expected = path, value, expected
        super().__init__(f"{path} = {value!r}: {expected}")

    @classmethod
    def from_message(cls, message: str) -> "RecipeError":
        """Wrap a message that already starts with its key (as pipeline.data's errors do)."""
        err = cls.__new__(cls)
        ValueError.__init__(err, message)
        err.path = re.split(r"[:= ]", message, maxsplit=1)[0]
        err.value, err.expected = None, message
        return err


class Section(BaseModel):
    # strict: a string is not silently turned into a number; frozen: a recipe never changes after loading
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class DataSpec(Section):
    train: str | list[str] = "bundled"  # "bundled", "hf:NAME[:CONFIG]", or local .txt/.jsonl/.parquet paths or globs
    text_field: str = "text"  # the text column of .jsonl/.parquet/HF rows
    validation_fraction: float = Field(0.05, gt=0, lt=0.5)  # of whole documents (books, plays)
    # "gpt2" (GPT-2's BPE), "bpe" (a byte-level BPE trained on the train split), or a directory holding a Hugging
    # Face tokenizer.json (a checkpoint's tokenizer; the default when teacher.load is a Hugging Face checkpoint)
    tokenizer: str = "bpe"
    vocab_size: int = Field(8192, ge=260, le=1_000_000)  # bpe only: small, so the output layer doesn't dominate
    seq_len: int = Field(256, ge=8)  # tokens per training sequence; also the model's context (learned positions)
    workers: int | None = Field(None, ge=0)  # processes that tokenize (0: in this one); None: this node's cores, at most 16

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_kind(cls, v: str, info: ValidationInfo) -> str:
        files = (info.context or {}).get("teacher_files")
        if v in ("gpt2", "bpe") or files is None or v == files.tokenizer_dir:
            return v
        raise RecipeError("data.tokenizer", v, "'gpt2', 'bpe', or a directory with a Hugging Face tokenizer.json "
                          "(a checkpoint's tokenizer files)")


class ModelSpec(Section):
    layers: int = Field(ge=1)
    hidden: int = Field(ge=8)
    heads: int = Field(ge=1)
    experts: list[int] = Field(min_length=1)  # one entry per MoE layer, bottom to top (pyramid: grows upwards)
    moe_every: int = Field(2, ge=1)  # MoE replaces the MLP on layers moe_every, 2*moe_every, ... (1-indexed)
    mlp_type: Literal["standard", "residual"] = "residual"  # residual: dense MLP + one routed expert, mixed per token
    top_k: Literal[1, 2] = 1
    capacity_factor: float = Field(1.0, gt=0)  # training capacity (tokens beyond it are dropped)
    eval_capacity_factor: float | None = Field(None, gt=0)  # None: no token dropping in eval/inference (the paper)
    min_capacity: int = Field(4, ge=0)
    aux_loss_coef: float = Field(0.01, ge=0)  # load-balancing loss weight (paper: 0.01)
    ffn_mult: int = Field(4, ge=1)  # expert and dense MLP: hidden -> ffn_mult*hidden -> hidden
    dropout: float = Field(0.0, ge=0, lt=1)
    tie_embeddings: bool = True
    init_std: float = Field(0.014, gt=0)  # paper: 0.014; output projections are scaled by 1/sqrt(2*layers)

    def moe_layer_count(self, layers: int) -> int:
        """MoE layers in a stack of `layers` (the teacher's, or a student's)."""
        return layers // self.moe_every

    @model_validator(mode="after")
    def _layout(self) -> Self:
        if self.hidden % self.heads:
            raise RecipeError("model.heads", self.heads, f"must divide model.hidden ({self.hidden})")
        n_moe = self.moe_layer_count(self.layers)
        if n_moe == 0:
            raise RecipeError("model.moe_every", self.moe_every,
                              f"must be <= model.layers ({self.layers}) so some layer is MoE")
        if len(self.experts) != n_moe:
            raise RecipeError("model.experts", self.experts, f"one entry per MoE layer: {n_moe} entries "
                              f"({self.layers} layers, MoE every {self.moe_every})")
        for i, e in enumerate(self.experts):
            if e < self.top_k:
                raise RecipeError(f"model.experts.{i}", e, f"at least model.top_k ({self.top_k}) experts")
        return self


class TrainSpec(Section):
    steps: int = Field(ge=1)  # optimizer steps
    micro_batch_size: int = Field(ge=1)  # sequences per rank per forward
    global_batch_size: int = Field(ge=1)  # sequences per optimizer step over all ranks
    lr: float = Field(gt=0)
    min_lr: float = Field(0.0, ge=0)  # cosine decays lr to this over `steps`
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: list[float] = Field([0.9, 0.95], min_length=2, max_length=2)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # fp16 (GPU only, dynamic loss scale) and bf16: ZeRO 1-2
    zero_stage: Literal[0, 1, 2] = 0  # DeepSpeed's MoE supports ZeRO 0-2
    checkpoint_every: int = Field(100, ge=1)
    checkpoint_keep: int = Field(2, ge=1)  # newest DeepSpeed checkpoints kept on disk
    eval_every: int = Field(100, ge=1)
    eval_batches: int | None = Field(8, ge=1)  # held-out micro-batches per validation (all ranks); None: the whole split
    log_every: int = Field(10, ge=1)


class EvalSpec(Section):
    """How a loaded teacher (teacher.load) is scored on the held-out split: nothing of it is trained."""

    micro_batch_size: int = Field(4, ge=1)  # sequences per rank per forward
    eval_batches: int | None = Field(8, ge=1)  # held-out micro-batches (all ranks); None: the whole split
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # a Hugging Face checkpoint's weights are loaded in it


class TeacherSpec(Section):
    # an existing teacher instead of training one: a directory made by `moe-pipeline teacher` (config.json,
    # model.safetensors, tokenizer/), or a Hugging Face checkpoint of a supported family (config.json with its
    # model_type, safetensors, tokenizer files: pipeline/hf_import.py)
    load: str | None = None
    # a Hugging Face config.json alone (recipes/hf/<family>.json: architecture, no weights): the teacher's shape
    # for `plan` and the recipe's checks while teacher.load is unset
    architecture: str | None = None
    # how the PR-MoE teacher is trained: required unless teacher.load or teacher.architecture names one (unused then)
    train: TrainSpec | None = None
    eval: EvalSpec = EvalSpec()  # how a loaded teacher is scored

    def trained(self) -> bool:
        """Whether the teacher stage trains a teacher (else it loads teacher.load)."""
        return self.load is None and self.architecture is None

    @model_validator(mode="after")
    def _train_when_trained(self) -> Self:
        if self.trained() and self.train is None:
            raise RecipeError("teacher.train", None, "required: how to train the teacher (steps, batch sizes, lr); "
                              "or teacher.load an existing one")
        return self


class StudentSpec(Section):
    layers: int = Field(ge=1)  # the Mixture-of-Students is shallower than its teacher (paper: 24 -> 21)
    experts: list[int] | None = None  # None: the experts of the teacher layers kept; fewer prunes experts
    # which teacher layers the student keeps, within each type (MoE, dense): the paper's rule (drop the
    # lowest MoE layers and the dense ones between them), evenly spaced, or the most influential on
    # calibration batches (Minitron's depth pruning: 1 - cosine(block input, block output))
    layer_selection: Literal["paper", "uniform", "importance"] = "paper"
    calibration_batches: int = Field(8, ge=1)  # importance, pruning: training micro-batches (per rank) to score on
    # which experts a pruned MoE layer keeps (student.experts below its teacher layer's count): the most chosen
    # by the router on calibration batches, or REAP's saliency (mean gate weight x expert output norm)
    expert_selection: Literal["frequency", "saliency"] = "frequency"
    # teacher: start from the kept layers' weights; random: from scratch, as the paper's reference code did
    init: Literal["teacher", "random"] = "teacher"
    train: TrainSpec


STOP_AT_FORMS = 'a step (an integer, e.g. 180) or a share of student.train.steps as a percentage string (e.g. "60%")'


def _percent(text: str) -> float | None:
    """60 for "60%", 12.5 for "12.5%"; None if `text` is not a percentage."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
    return float(m.group(1)) if m else None


class KDSpec(Section):
    """total = alpha*CE + beta(step)*T^2*D(p_teacher(T) || p_student(T)) + aux_loss_coef*aux."""

    alpha: float = Field(1.0, ge=0)  # weight of the student's cross-entropy with the labels
    beta: float = Field(1.0, ge=0)  # weight of the distillation term (paper: 1); 0 = no KD at all
    temperature: float = Field(1.0, gt=0)  # T (paper: 1)
    divergence: Literal["kl", "reverse_kl", "jsd"] = "kl"  # kl: forward KL(teacher || student), the paper's
    # staged KD: from this step (an int, e.g. 180) or share of student.train.steps (a percentage string,
    # e.g. "60%"), beta = 0 and the teacher no longer runs; None: KD all the way. A bare float is refused:
    # 1 and 1.0 would read alike. Paper: stop for the last ~40% of training.
    stop_at: int | str | None = "60%"
    decay_steps: int = Field(0, ge=0)  # ramp beta linearly to 0 over this many steps before stop_at (0: a cut)

    @field_validator("stop_at", mode="before")
    @classmethod
    def _stop_at_form(cls, value: Any) -> Any:
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value  # a step; checked against student.train.steps by Recipe
        if isinstance(value, str) and (share := _percent(value)) is not None:
            if not 0 < share <= 100:
                raise RecipeError("kd.stop_at", value, 'a share of student.train.steps in (0%, 100%], e.g. "60%"')
            return value
        expected = STOP_AT_FORMS
        if isinstance(value, float):  # the old spelling: say what it becomes
            fixes = [f'"{value * 100:g}%" if it meant a share'] if 0 < value <= 1 else []
            fixes += [f"{int(value)} if it meant a step"] if value.is_integer() and value >= 0 else []
            expected += f"; write {' or '.join(fixes)}" if fixes else ""
        raise RecipeError("kd.stop_at", value, expected)

    @model_validator(mode="after")
    def _decay_needs_a_stop(self) -> Self:
        if self.decay_steps and self.stop_at is None:
            raise RecipeError("kd.decay_steps", self.decay_steps, "a ramp down to kd.stop_at, which is null (KD all "
                              'the way): set kd.stop_at (a step, or a share such as "60%") or kd.decay_steps to 0')
        return self


class MonitorSpec(Section):
    """DeepSpeed's own monitors (its `tensorboard`, `csv_monitor` and `wandb` config sections), fed with what
    metrics.jsonl records: each stage writes under `output_path` (default RUN/monitor) as job `<recipe>-<stage>`."""

    tensorboard: bool = False  # needs the tensorboard package
    csv: bool = False  # DeepSpeed's csv_monitor: one CSV file per quantity
    wandb: bool = False  # needs the wandb package; offline (WANDB_MODE=offline) unless WANDB_MODE says otherwise
    wandb_project: str = "moe-pipeline"
    output_path: str | None = None  # None: the run directory's monitor/

    @model_validator(mode="after")
    def _packages_installed(self) -> Self:
        import importlib.util

        for field, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if getattr(self, field) and importlib.util.find_spec(package) is None:
                raise RecipeError(f"monitor.{field}", True, f"the {package} package installed "
                                  f"(`pip install {package}`), or monitor.{field}: false")
        return self


class DistributedSpec(Section):
    nproc: int = Field(1, ge=1)  # ranks on this node when the CLI launches them itself
    ep_size: int | None = Field(None, ge=1)  # expert-parallel degree; None: per layer min(world size, experts)


class Recipe(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    seed: int = 1234
    data: DataSpec = DataSpec()
    model: ModelSpec | None = None  # the PR-MoE teacher to train; optional for a Hugging Face teacher (its config.json)
    teacher: TeacherSpec
    student: StudentSpec
    kd: KDSpec = KDSpec()
    distributed: DistributedSpec = DistributedSpec()
    monitor: MonitorSpec = MonitorSpec()

    _hf_config: dict | None = PrivateAttr(None)  # from the validation context's TeacherFiles

    # -- derived facts, computed from the fields above (never stored twice) --

    def hf_teacher(self) -> dict | None:
        """The teacher's Hugging Face config.json (teacher.load's checkpoint, else teacher.architecture), or None
        for a PR-MoE teacher (the model section; a directory made by `moe-pipeline teacher`): read once, before
        validation (`read_teacher_files`)."""
        return self._hf_config

    def teacher_layout(self) -> tuple[int, list[int], list[int], int]:
        """(layers, 0-indexed MoE layers, experts per MoE layer, top_k) of the teacher."""
        raw = self.hf_teacher()
        if raw is not None:
            from pipeline.hf_import import HFImportError, model_config

            try:
                cfg = model_config(raw)
            except HFImportError as err:
                raise RecipeError("teacher.load" if self.teacher.load else "teacher.architecture",
                                  self.teacher.load or self.teacher.architecture, str(err)) from None
            return cfg.layers, list(cfg.moe_layers), list(cfg.experts), cfg.top_k
        m = self.model
        return m.layers, list(range(m.moe_every - 1, m.layers, m.moe_every)), list(m.experts), m.top_k

    def moe_layer_count(self, layers: int) -> int:
        """MoE layers in a student of `layers` layers: the PR-MoE's every `moe_every`-th, or for a Hugging Face
        teacher the teacher's share of MoE layers (all of them in Mixtral, OLMoE and the published Qwen models)."""
        if self.model is not None and self.hf_teacher() is None:
            return self.model.moe_layer_count(layers)
        total, moe, _, _ = self.teacher_layout()
        return layers - round(layers * (total - len(moe)) / total)

    def student_experts(self) -> list[int]:
        """The student's experts per MoE layer: given, or the teacher's top ones (the paper's rule)."""
        if self.student.experts is not None:
            return list(self.student.experts)
        experts = self.teacher_layout()[2]
        drop = len(experts) - self.moe_layer_count(self.student.layers)
        return list(experts[max(drop, 0):])

    def kd_stop_step(self) -> int | None:
        """The first student step without KD, or None for KD all the way."""
        stop, steps = self.kd.stop_at, self.student.train.steps
        if isinstance(stop, str):
            return round(_percent(stop) * steps / 100)
        return stop

    def vocab_size(self) -> int:
        """The model's embedding rows: the tokenizer's size padded to a multiple of VOCAB_MULTIPLE (a Hugging Face
        teacher's: its config's vocab_size, padded as it was)."""
        raw = self.hf_teacher()
        if raw is not None:
            return int(raw["vocab_size"])
        tok = self.data.tokenizer
        n = GPT2_VOCAB if tok == "gpt2" else self.data.vocab_size if tok == "bpe" else _tokenizer_size(tok)
        return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def _teacher_unknown(self) -> bool:
        """A stored recipe whose Hugging Face teacher is no longer where it was: its cross-checks were made when
        it ran, and cannot be made again here."""
        return self.model is None and self.hf_teacher() is None

    def trainings(self) -> list[tuple[str, TrainSpec]]:
        """The train sections that train something: the student's, and the teacher's unless it is loaded."""
        teacher = [("teacher.train", self.teacher.train)] if self.teacher.trained() else []
        return teacher + [("student.train", self.student.train)]

    def _world(self, info: ValidationInfo) -> int:
        """The world size a recipe is checked for: the caller's (context "world_size"), else distributed.nproc."""
        return (info.context or {}).get("world_size") or self.distributed.nproc

    # -- rules across sections (each section's own rules are on its class); run in this order --

    @model_validator(mode="after")
    def _teacher_files(self, info: ValidationInfo) -> Self:
        files = (info.context or {}).get("teacher_files")
        self._hf_config = files.config if files is not None else None
        return self

    @model_validator(mode="after")
    def _teacher_is_described(self, info: ValidationInfo) -> Self:
        stored = (info.context or {}).get("stored")
        raw = self.hf_teacher()
        if raw is None and self.model is None and not (self.teacher.load and stored):
            raise RecipeError("model", None, "required: the PR-MoE teacher's shape; it may be left out only when "
                              "teacher.load or teacher.architecture names a Hugging Face checkpoint's config.json")
        if raw is not None and self.model is not None:  # given anyway: it must be the checkpoint's
            layers, _, experts, top_k = self.teacher_layout()
            theirs = {"layers": layers, "hidden": raw["hidden_size"], "heads": raw["num_attention_heads"],
                      "experts": experts, "top_k": top_k}
            for key, value in theirs.items():
                if getattr(self.model, key) != value:
                    raise RecipeError(f"model.{key}", getattr(self.model, key), f"the teacher checkpoint's {value} "
                                      f"({raw['model_type']}): leave the model section out, or make it agree")
        if raw is not None and self.data.seq_len > raw["max_position_embeddings"]:
            raise RecipeError("data.seq_len", self.data.seq_len, f"at most the teacher's context "
                              f"(max_position_embeddings {raw['max_position_embeddings']})")
        return self

    @model_validator(mode="after")
    def _student_fits_teacher(self) -> Self:
        if self._teacher_unknown():
            return self
        s = self.student
        layers, moe, experts, top_k = self.teacher_layout()
        pr_moe = self.hf_teacher() is None
        if s.layers >= layers:
            raise RecipeError("student.layers", s.layers, f"must be < teacher layers ({layers})")
        n_student_moe = self.moe_layer_count(s.layers)
        if n_student_moe == 0:
            raise RecipeError("student.layers", s.layers, f"at least model.moe_every ({self.model.moe_every}) so the "
                              "student keeps an MoE layer" if pr_moe else f"keeps no MoE layer (the teacher's are "
                              f"{moe}): more layers, so the student keeps one")
        student_experts = self.student_experts()
        if len(student_experts) != n_student_moe:
            layout = f"{s.layers} layers, MoE every {self.model.moe_every}" if pr_moe else f"{s.layers} layers"
            raise RecipeError("student.experts", s.experts, f"one entry per student MoE layer: {n_student_moe} "
                              f"entries ({layout})")
        for i, e in enumerate(student_experts):
            if e < top_k:
                raise RecipeError(f"student.experts.{i}", e, f"at least {'model.top_k' if pr_moe else 'the teacher' + chr(39) + 's top_k'} ({top_k}) experts")
            if e > max(experts):
                raise RecipeError(f"student.experts.{i}", e, f"at most the teacher's largest MoE layer "
                                  f"({max(experts)} experts); below its kept teacher layer's count prunes experts")
        return self

    @model_validator(mode="after")
    def _schedules(self) -> Self:
        for name, train in self.trainings():
            if train.min_lr > train.lr:
                raise RecipeError(f"{name}.min_lr", train.min_lr, f"<= {name}.lr ({train.lr})")
            if train.warmup_steps > train.steps:
                raise RecipeError(f"{name}.warmup_steps", train.warmup_steps, f"<= {name}.steps ({train.steps})")
            if not all(0 <= b < 1 for b in train.betas):
                raise RecipeError(f"{name}.betas", train.betas, "two numbers in [0, 1)")
            if train.precision != "fp32" and train.zero_stage == 0:
                # without ZeRO, DeepSpeed's engine never scales an fp16 loss though its fp16 optimizers divide the
                # gradients by the loss scale (updates 2^16 times too small, no clipping), and sums bf16 gradients
                # over the micro-steps in bf16; its ZeRO optimizers scale fp16 losses, accumulate bf16 in fp32
                # (data_types.grad_accum_dtype) and clip by the norm of every gradient, the experts' included
                why = "its loss scaled" if train.precision == "fp16" else "gradients accumulated and reduced in fp32"
                raise RecipeError(f"{name}.zero_stage", 0, f"1 or 2 with {name}.precision {train.precision} ({why}), "
                                  f"e.g. --set {name}.zero_stage=1; or precision fp32")
        return self

    @model_validator(mode="after")
    def _kd_stop_within_student_steps(self) -> Self:
        stop, steps = self.kd.stop_at, self.student.train.steps
        if isinstance(stop, int) and not 0 <= stop <= steps:
            raise RecipeError("kd.stop_at", stop, f"a step between 0 and student.train.steps ({steps})")
        stop_step = self.kd_stop_step()
        if stop_step is not None and self.kd.decay_steps > stop_step:
            raise RecipeError("kd.decay_steps", self.kd.decay_steps, f"<= the kd.stop_at step ({stop_step})")
        return self

    @model_validator(mode="after")
    def _experts_split_over_world(self, info: ValidationInfo) -> Self:
        world, ep = self._world(info), self.distributed.ep_size
        if ep is not None and world % ep:
            raise RecipeError("distributed.ep_size", ep, f"must divide the world size ({world})")
        if self._teacher_unknown():
            return self
        for key, experts in (("model.experts", self.teacher_layout()[2]), ("student.experts", self.student_experts())):
            for i, e in enumerate(experts):
                if ep is not None and e % ep:
                    raise RecipeError(f"{key}.{i}", e, f"divisible by distributed.ep_size ({ep})")
                degree = ep or min(world, e)  # the default: as many ranks as experts, at most the world
                if ep is None and (e % degree or world % degree):
                    raise RecipeError(f"{key}.{i}", e, f"experts split evenly over {world} ranks (expert-parallel "
                                      f"degree min(world, experts) = {degree}); set distributed.ep_size to a common "
                                      f"divisor of the expert counts and the world size")
        return self

    @model_validator(mode="after")
    def _batches_split_over_world(self, info: ValidationInfo) -> Self:
        world = self._world(info)
        for name, train in self.trainings():
            per_step = train.micro_batch_size * world
            if train.global_batch_size % per_step:
                raise RecipeError(f"{name}.global_batch_size", train.global_batch_size, f"a multiple of "
                                  f"micro_batch_size x world size ({train.micro_batch_size} x {world} = {per_step})")
        return self


# -- loading ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TeacherFiles:
    """What validating a recipe needs from files, read once before it (`read_teacher_files`)."""

    config: dict | None  # the teacher's Hugging Face config.json: teacher.load's checkpoint, else teacher.architecture
    tokenizer_dir: str | None  # data.tokenizer, when it is a directory holding a tokenizer.json (or stored)


def _str_at(raw: Any, *keys: str) -> str | None:
    for key in keys:
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw if isinstance(raw, str) else None


def _hf_config_file(path: Path, key: str, value: str, parsed: dict | None = None) -> dict:
    """The supported Hugging Face config.json at `path` (`parsed`: already read), or a RecipeError naming `key`."""
    from pipeline.hf_import import HFImportError, check_family, read_config_file

    try:
        return check_family(parsed, path) if parsed is not None else \
            read_config_file(path, "a config.json, e.g. recipes/hf/mixtral.json")
    except HFImportError as err:
        raise RecipeError(key, value, str(err)) from None


def read_teacher_files(raw: dict, stored: bool = False) -> tuple[dict, TeacherFiles]:
    """The files a recipe names, read once, before validation: the teacher's Hugging Face config.json (teacher.load,
    a checkpoint directory or Hub name, else teacher.architecture) and data.tokenizer's directory. Returns the
    mapping with data.tokenizer defaulted to a checkpoint's own tokenizer, and what was read. `stored`: a recipe a
    run or package stored, whose teacher and tokenizer directories may be gone by now."""
    import json

    load, arch = _str_at(raw, "teacher", "load"), _str_at(raw, "teacher", "architecture")
    config = None
    if load is not None:
        path = Path(load) / "config.json"
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            found = None  # no teacher there yet: the teacher stage says so when it reads it
        if isinstance(found, dict) and "model_type" in found:  # else our own teacher directory: the stage checks it
            config = _hf_config_file(path, "teacher.load", load, found)
        elif found is None and not stored and not Path(load).is_dir() and not isinstance(raw.get("model"), dict):
            from pipeline.hf_import import HFImportError, read_hf_config

            try:  # no shape to check against: a Hub name, say; read_hf_config says what to do
                read_hf_config(Path(load))
            except HFImportError as err:
                raise RecipeError("teacher.load", load, str(err).split(": ", 1)[1]) from None
    elif arch is not None:
        config = _hf_config_file(Path(arch), "teacher.architecture", arch)
    data = raw.get("data", {})
    if config is not None and load is not None and isinstance(data, dict) and "tokenizer" not in data \
            and (Path(load) / "tokenizer.json").is_file():  # a checkpoint's own tokenizer, unless one is named
        raw = {**raw, "data": {**data, "tokenizer": load}}
    tokenizer = _str_at(raw, "data", "tokenizer")
    found_dir = tokenizer if tokenizer and (stored or (Path(tokenizer) / "tokenizer.json").is_file()) else None
    return raw, TeacherFiles(config, found_dir)


@functools.lru_cache(maxsize=16)
def _tokenizer_size(directory: str) -> int:
    """Entries of the Hugging Face tokenizer in `directory` (added tokens included)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `3e-4` as a string; recipes mean a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b.c=VALUE` with VALUE parsed as YAML; the key path must exist in the schema (checked later)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError("--set", item, "expected KEY.PATH=VALUE, e.g. teacher.train.steps=50")
        path, value = item.split("=", 1)
        keys = path.strip().split(".")
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise RecipeError(".".join(keys[: depth + 1]), child, "a mapping, so it has no sub-keys")
            node = child
        node[keys[-1]] = parse_value(value)
    return raw


def _first_error(err: ValidationError) -> RecipeError:
    e = err.errors(include_url=False)[0]
    more = f" (and {err.error_count() - 1} more problem(s))" if err.error_count() > 1 else ""
    raised = e.get("ctx", {}).get("error")
    if isinstance(raised, RecipeError):  # from a validator of ours: its path and words, as raised
        return RecipeError(raised.path, raised.value, raised.expected + more)
    path = ".".join(str(p) for p in e["loc"]) or "(recipe)"
    expected = e["msg"]
    if e["type"] == "extra_forbidden":
        expected = "unknown key; check its spelling against pipeline/recipe.py"
    elif e["type"] == "missing":
        expected = "required key is missing"
    return RecipeError(path, e.get("input"), expected + more)


def load_recipe(path: str | Path, overrides: list[str] = (), world_size: int | None = None) -> Recipe:
    """Read, override, validate. Raises RecipeError (one line) on any problem; writes nothing."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError("recipe", str(path), "an existing YAML file, e.g. recipes/tiny.yaml")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as err:
        raise RecipeError("recipe", str(path), f"valid YAML ({err})".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise RecipeError("recipe", str(path), "a YAML mapping at the top level")
    raw = apply_overrides(raw, list(overrides))
    return validate(raw, world_size)


def validate(raw: dict, world_size: int | None = None, stored: bool = False) -> Recipe:
    """A recipe from a parsed mapping, checked for `world_size` ranks (None: its distributed.nproc). `stored`: one
    a run or package stored, whose Hugging Face teacher and tokenizer directories may be gone by now."""
    raw, files = read_teacher_files(raw, stored) if isinstance(raw, dict) else (raw, None)
    try:
        return Recipe.model_validate(raw, context={"world_size": world_size, "stored": stored, "teacher_files": files})
    except ValidationError as err:
        raise _first_error(err) from None


def validate_stored(raw: dict) -> Recipe:
    """A recipe that a run directory (recipe.yaml) or a package (its manifest) stored. Those written before
    kd.stop_at took percentages hold its share as a bare float (0.6): read as the share it meant ("60%").
    A recipe a user writes gets no such reading (`validate`: a bare float is an error)."""
    kd = raw.get("kd") if isinstance(raw, dict) else None
    stop = kd.get("stop_at") if isinstance(kd, dict) else None
    if isinstance(stop, float) and 0 < stop <= 1:
        raw = {**raw, "kd": {**kd, "stop_at": f"{stop * 100:g}%"}}
    teacher = raw.get("teacher") if isinstance(raw, dict) else None
    if isinstance(teacher, dict) and (teacher.get("load") or teacher.get("architecture")) \
            and isinstance(teacher.get("train"), dict) and "eval" not in teacher:
        # stored before teacher.eval: a loaded teacher was scored with teacher.train's settings
        train = teacher["train"]
        raw = {**raw, "teacher": {**teacher, "eval": {k: train[k] for k in ("micro_batch_size", "eval_batches",
                                                                            "precision") if k in train}}}
    return validate(raw, stored=True)


def load_stored_recipe(path: str | Path) -> Recipe:
    """A run directory's recipe.yaml (`validate_stored`)."""
    return validate_stored(yaml.load(Path(path).read_text(), Loader=_Loader))


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


# settings that change how a run is made or watched, not what it computes: a run directory accepts them changed
RUN_INDEPENDENT = ("data.workers", "monitor.")


def diff_recipes(a: Recipe, b: Recipe) -> list[str]:
    """Key paths whose values differ, for 'this run directory holds another recipe' errors (RUN_INDEPENDENT
    ones left out)."""
    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: d}
    fa, fb = flat(a.model_dump(mode="json")), flat(b.model_dump(mode="json"))
    unused = ("teacher.train",) if not (a.teacher.trained() or b.teacher.trained()) else ()  # a loaded teacher's
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k) and not k.startswith(RUN_INDEPENDENT + unused)]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    try:
        print(dump_recipe(load_recipe(args.recipe, args.set)), end="")
    except RecipeError as err:
        print(f"recipe error: {err}", file=sys.stderr)
        sys.exit(2)
