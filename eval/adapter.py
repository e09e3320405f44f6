"""lm-evaluation-harness adapter: our PR-MoE models as an lm-eval `LM`, registered as `moe-pipeline`.

    moe-pipeline lm-eval run --model moe-pipeline --model_args path=runs/tiny/student --tasks tiny_lastword
    moe-pipeline lm-eval run --model moe-pipeline --model_args path=runs/tiny,stage=teacher,dtype=bfloat16 --tasks piqa

(`moe-pipeline lm-eval` is lm-eval's own command line with this model registered: eval/lm_eval_cli.py), or from
Python: `MoEPipelineLM(path=...)` passed to `lm_eval.simple_evaluate(model=lm, ...)`.

`model_args` (each also a keyword argument of `MoEPipelineLM`; an unknown one is an error naming it):

  path            a run directory (then `stage` picks teacher or student), a stage directory or a package
  stage           `student` (default) or `teacher`, for a run directory
  batch_size      requests per forward (default 16; lm-eval's `auto` means 32)
  max_length      context window used, at most the model's (default the model's `seq_len`)
  dtype           `float32`, `bfloat16` or `float16` (default: the model's own; fp32 for a stage directory)
  ep_size         expert-parallel degree (default: the world size, at most each MoE layer's experts)
  max_gen_toks    generate_until's default budget when a request sets none (default 256)
  seed            of sampled generation (default 1234)
  progress        progress bars on rank 0 (default true; `moe-pipeline eval` turns them off)

lm-eval itself also passes `batch_size`, `max_batch_size` and `device` (its `--batch_size`,
`--max_batch_size`, `--device`) and, with `--trust_remote_code`, `trust_remote_code=True`:
accepted, and `max_batch_size`, `device` and `trust_remote_code` are ignored (the device is this
rank's, chosen when the model is loaded; no remote code is ever run).

  * `loglikelihood` (via lm-eval's `TemplateLM`): requests sorted longest first (lm-eval's
    `Collator`) and batched `batch_size` at a time, right-padded (the model is causal and MoE
    routing in eval mode drops no tokens, so padding changes no real position), context and
    continuation left-truncated to the model's context window together (the continuation
    always kept), `is_greedy` = every continuation token is the argmax at its position;
  * `loglikelihood_rolling`: lm-eval's disjoint rolling windows over the whole text (each token
    scored once, with up to `max_length - 1` tokens of context), summed;
  * `generate_until`: KV-cache decoding, greedy unless the request asks for `do_sample` with a
    temperature (then seeded by `seed`), stopping at the first `until` string (cut off the
    output), the end-of-document token, `max_gen_toks` or the context window.

Expert parallelism: with several ranks (under the DeepSpeed launcher) the model's experts are split
over them; lm-eval is told there is one rank (`rank`/`world_size` stay 0/1), so every rank gets
the same requests and runs the same batches, as expert parallelism needs. Only the real rank 0
shows progress; callers write results from rank 0 only (`self.dist_rank`).
"""

from __future__ import annotations

import difflib
import inspect
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from export.serve.request import Detokenizer
from pipeline.model import KVCache

NAME = "moe-pipeline"


@register_model(NAME)
class MoEPipelineLM(TemplateLM):
    """A run's teacher or student, a stage directory, or a package, evaluated with our model code."""

    def __init__(self, path: str, stage: str = "student", batch_size: int | str = 16, max_length: int | None = None,
                 dtype: str | None = None, ep_size: int | None = None, max_gen_toks: int = 256, seed: int = 1234,
                 progress: bool = True, device: str | None = None, max_batch_size: int | None = None,
                 trust_remote_code: bool = False, **unknown) -> None:
        # device, max_batch_size, trust_remote_code: lm-eval passes them (module docstring); any other key is a typo
        if unknown:  # before anything is loaded
            raise ValueError(unknown_args_message(unknown))
        if not isinstance(progress, bool):
            raise ValueError(f"progress={progress!r}: true or false")
        super().__init__()
        self.progress = progress
        from eval.models import STAGES, load_model, resolve
        from pipeline import dist

        refs = resolve(path)
        if len(refs) > 1:  # a run directory: pick the stage
            if stage not in STAGES:
                raise ValueError(f"stage={stage!r}: one of {', '.join(STAGES)}")
            refs = [r for r in refs if r.stage == stage]
            if not refs:
                raise FileNotFoundError(f"{path}: its {stage} stage is not finished")
        self.ref = refs[0]
        self.ranks = dist.init()
        self.model, self.tokenizer = load_model(self.ref.path, self.ranks, ep_size, dtype)
        self.dtype = dtype
        self._device = next(self.model.parameters()).device
        if isinstance(batch_size, str):
            batch_size = 32 if batch_size.startswith("auto") else int(batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be at least 1")
        self.batch_size = batch_size
        context = self.model.cfg.seq_len
        if max_length is not None and not 1 < int(max_length) <= context:
            raise ValueError(f"max_length={max_length}: between 2 and the model's context window ({context})")
        self._max_length = int(max_length or context)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        self.tokenizer.model_max_length = 1 << 60  # we truncate to the context window ourselves
        self._eot = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

    # -- what lm-eval asks about ---------------------------------------------------------------

    @property
    def dist_rank(self) -> int:
        """This process's rank in the expert-parallel world (lm-eval's `rank` is always 0)."""
        return self.ranks.rank

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.ref.path)

    def get_model_info(self) -> dict:
        from eval.models import describe

        return {"model_name": self.ref.name, "model_stage": self.ref.stage, "model_dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
                "ep_world_size": self.ranks.world, **describe(self.ref.path)}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _bar(self, total: int, desc: str, disable: bool):
        return tqdm(total=total, desc=desc, disable=disable or not self.progress or self.dist_rank != 0)

    # -- scoring ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _continuation_logprobs(self, rows: list[list[int]], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Log-softmax (fp32) at the positions [start, end) of each right-padded row that predict its continuation.

        The vocabulary projection runs only at those positions (a few per request), not at every
        position of the batch: on the tiny model it is about half of a full forward's FLOPs.
        """
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self._eot, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        hidden = self.model(ids.to(self._device), hidden_only=True).hidden  # [B, L, C]
        picked = torch.cat([hidden[i, start:end] for i, (start, end) in enumerate(spans)])  # [sum(cont), C]
        logp = F.log_softmax(self.model.lm_head(picked).float(), dim=-1)
        return list(logp.split([end - start for start, end in spans]))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """[(sum of continuation log-probs, is_greedy)] for ((context, continuation), ctx_ids, cont_ids) requests."""
        def sort_key(req):  # longest first: the first batch fails fast on memory, padding stays small
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        collator = Collator(requests, sort_fn=sort_key)
        results = []
        bar = self._bar(len(requests), "loglikelihood", disable_tqdm)
        for chunk in collator.get_batched(n=override_bs or self.batch_size):
            rows, spans, conts = [], [], []
            for _, ctx, cont in chunk:
                if not cont:
                    raise ValueError("an empty continuation cannot be scored")
                whole = (ctx + cont)[-(self.max_length + 1):]  # left-truncate, keep the continuation
                inp = whole[:-1]
                cont = cont[-len(inp):] if len(cont) > len(inp) else cont
                rows.append(inp)
                spans.append((len(inp) - len(cont), len(inp)))  # positions whose next token is the continuation
                conts.append(cont)
            for (key, _, _), cont, logp in zip(chunk, conts, self._continuation_logprobs(rows, spans)):
                target = torch.tensor(cont, device=logp.device)
                score = float(logp.gather(1, target[:, None]).sum())
                greedy = bool((logp.argmax(-1) == target).all())
                results.append((score, greedy))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, (score, greedy))
                bar.update(1)
        bar.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else []
        totals = [0.0] * len(requests)
        for i, (score, _) in zip(owner, scores):
            totals[i] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation -------------------------------------------------------------------------------

    @torch.no_grad()
    def _generate(self, context: list[int], max_new: int, until: list[str], temperature: float,
                  generator: torch.Generator | None) -> str:
        max_new = max(1, min(max_new, self.max_length - 1))
        context = (context or [self.prefix_token_id])[-(self.max_length - max_new):]  # left-truncate: room to generate
        cache = KVCache(self.model.cfg, 1, len(context) + max_new, device=self._device,
                        dtype=next(self.model.parameters()).dtype)
        step_in = torch.tensor([context], dtype=torch.long, device=self._device)
        # the text so far, decoded a token at a time as the server does (not the whole output again every token)
        out = SimpleNamespace(generated=[], stream=None)
        detok = Detokenizer(self.tokenizer)
        text = ""
        for _ in range(max_new):
            logits = self.model(step_in, cache=cache).logits[0, -1].float()
            if temperature > 0:
                probs = F.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            else:
                token = int(logits.argmax())
            if token == self._eot:
                break
            out.generated.append(token)
            text = detok(out)
            if any(s and s in text for s in until):
                break
            step_in = torch.tensor([[token]], dtype=torch.long, device=self._device)
        text = detok.final(out) if out.generated else ""  # the tokenizer's decode of the whole output, once
        for s in until:  # cut at the first stop string
            if s and s in text:
                text = text[:text.index(s)]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        bar = self._bar(len(requests), "generate_until", disable_tqdm)
        eot_text = self.tok_decode([self._eot])
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or [eot_text]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            generator = None
            if temperature > 0:
                generator = torch.Generator().manual_seed(int(kwargs.pop("seed", self.seed)))
            text = self._generate(self.tok_encode(context), max_new, until, temperature, generator)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            bar.update(1)
        bar.close()
        return results


def model_args() -> list[str]:
    """The `model_args` keys `MoEPipelineLM` accepts, in its signature's order."""
    params = inspect.signature(MoEPipelineLM.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


def unknown_args_message(unknown: dict) -> str:
    accepted = model_args()
    keys = ", ".join(repr(k) for k in unknown)
    hints = [f"{m[0]!r} for {k!r}" for k in unknown if (m := difflib.get_close_matches(str(k), accepted, n=1))]
    return (f"model_args: unknown key{'s' if len(unknown) > 1 else ''} {keys} for {NAME}; accepted: "
            f"{', '.join(accepted)}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
