"""What KD costs per student step: plain step vs KD step vs a step after `kd.stop_at` (tiny recipe sizes).

    .venv/bin/python benchmarks/kd_step_time.py                 # under a minute on 2 CPU cores
    .venv/bin/python benchmarks/kd_step_time.py --repeats 40 --teacher-dir runs/tiny/teacher

In one process (a 1-rank DeepSpeed process group, `--threads` threads), with the tiny recipe's
teacher (`pipeline.build.teacher_config`, 6 layers, experts [4, 4, 8]) and its Mixture-of-Students
(`distill.student.select_layers` with the paper's rule and `student_config`: 5 layers, experts
[4, 8]), both `moe_impl="deepspeed"`, this times one student optimizer step on one of the recipe's
micro-batches (8 x 128 tokens of the real training split, the same batches for every mode) in
three modes:

  * plain:      `pipeline.train.lm_step` (CE + aux; no teacher), as the teacher stage trains;
  * kd:         `distill.stage.make_kd_step` with kd.stop_at = null (beta = 1): the teacher's
                forward in eval mode under no_grad, then CE + beta*T^2*KL + aux;
  * after_stop: `make_kd_step` with kd.stop_at = 0 (beta = 0 from step 0): the real staged-KD
                code path after the stop, which must skip the teacher entirely.

Each step is `loss, _ = step_fn(student, batch, step); loss.backward(); opt.step(); opt.zero_grad()`
with plain torch AdamW on the student (no DeepSpeed engine: the engine's own cost is the same in
every mode). The teacher's forward alone is timed too, to explain the KD overhead. The teacher has
random weights unless `--teacher-dir` names a trained one (routing, and so the eval-mode expert
capacity, depends on the weights a little).

Modes are interleaved (each repeat runs every mode once, in a rotated order) after `--warmup`
untimed rounds, so a slow moment of a shared machine hits all of them; the reported ratios are
the medians of each repeat's mode time over the plain time of the same repeat. On CPU,
`pipeline.dist.init` raises glibc's mmap threshold as training does (`tune_cpu_allocator`);
--no-malloc-tuning measures without it (plain steps get slower, the KD ratio lower). Targets: KD/plain
<= 1.5, after_stop/plain <= 1.05. Results: a table on stdout and `kd_step_time.json` under `--out`
(default `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny.yaml"
MODES = ("plain", "kd", "after_stop")
TARGETS = {"kd": 1.5, "after_stop": 1.05}


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where the JSON goes")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per mode (median)")
    p.add_argument("--no-malloc-tuning", dest="malloc_tuning", action="store_false",
                   help="leave glibc malloc alone (pipeline/dist.py tune_cpu_allocator), as training would not")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds of every mode first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--teacher-dir", type=Path, default=None,
                   help="a finished teacher stage directory (config.json, model.safetensors) to load")
    return p.parse_args(argv)


def build(args, ranks) -> dict:
    """The recipe's teacher (loaded, or random), its student with an AdamW, every round's batch, each mode's step."""
    import torch

    from distill.stage import load_teacher, make_kd_step
    from distill.student import select_layers, student_config
    from pipeline import data as data_lib
    from pipeline.artifacts import cache_root
    from pipeline.build import set_groups, teacher_config as model_config
    from pipeline.model import GPT, init_weights
    from pipeline.recipe import load_recipe
    from pipeline.train import lm_step

    recipe = load_recipe(RECIPE)
    kd_all = load_recipe(RECIPE, ["kd.stop_at=null"])
    after_stop = load_recipe(RECIPE, ["kd.stop_at=0"])
    assert kd_all.kd_stop_step() is None and after_stop.kd_stop_step() == 0

    # the teacher: frozen, eval mode (no token dropping), as distill.stage.load_teacher makes it
    if args.teacher_dir is not None:
        teacher = load_teacher(args.teacher_dir, recipe, ranks)
    else:
        teacher = GPT(model_config(recipe), moe_impl="deepspeed")
        set_groups(teacher)  # outside deepspeed.initialize the EP groups are made by hand
        init_weights(teacher, recipe.seed)
        teacher.eval().requires_grad_(False)
    s = recipe.student
    kept = select_layers(teacher.cfg, s.layers, recipe.moe_layer_count(s.layers), "paper")
    student = GPT(student_config(teacher.cfg, kept), moe_impl="deepspeed")
    set_groups(student)
    init_weights(student, recipe.seed + 1)
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4, betas=tuple(s.train.betas),
                            weight_decay=s.train.weight_decay)

    prepared = data_lib.prepare_data(recipe.data, cache_root())
    train = data_lib.PackedTokens(prepared.train, recipe.data.seq_len, prepared.eod_id)
    micro = s.train.micro_batch_size
    rounds = args.warmup + args.repeats
    ids = data_lib.global_sample_ids(train.num_blocks, recipe.seed, 0, rounds * micro)
    batches = [train.batch(ids[i * micro:(i + 1) * micro]) for i in range(rounds)]
    step_fns = {"plain": lm_step, "kd": make_kd_step(teacher, kd_all), "after_stop": make_kd_step(teacher, after_stop)}
    return {"recipe": recipe, "teacher": teacher, "student": student, "kept": kept, "opt": opt, "micro": micro,
            "batches": batches, "step_fns": step_fns}


def time_modes(m: dict, warmup: int) -> dict[str, list[float]]:
    """Seconds of each mode's optimizer step (and of the teacher's forward alone) per round after the warm-up
    rounds; the modes in a rotated order each round, so that none is always first or last."""
    import torch

    student, opt, step_fns, teacher = m["student"], m["opt"], m["step_fns"], m["teacher"]

    def one_step(mode: str, batch: dict, step: int) -> float:
        t0 = time.perf_counter()
        loss, _ = step_fns[mode](student, batch, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def teacher_forward(batch: dict) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            teacher(batch["input_ids"])
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {mode: [] for mode in (*MODES, "teacher_fwd")}
    for r, batch in enumerate(m["batches"]):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]  # rotated: no mode always first or last
        round_times = {mode: one_step(mode, batch, r) for mode in order}
        round_times["teacher_fwd"] = teacher_forward(batch)
        if r >= warmup:
            for mode, t in round_times.items():
                times[mode].append(t)
    return times


def report(m: dict, args, ms: dict, spread: dict, ratios: dict) -> None:
    teacher, student, recipe = m["teacher"], m["student"], m["recipe"]
    print()
    print(f"== one student optimizer step, {RECIPE} sizes: teacher {teacher.cfg.layers} layers experts "
          f"{list(teacher.cfg.experts)}, student {student.cfg.layers} layers (teacher layers {m['kept']}) experts "
          f"{list(student.cfg.experts)}; {m['micro']} x {recipe.data.seq_len} tokens, fp32, {args.threads} threads, "
          f"median of {args.repeats} interleaved repeats ==")
    print(f"{'mode':<12} {'median ms':>9} {'spread':>7} {'/ plain':>8} {'target':>7}")
    for mode in (*MODES, "teacher_fwd"):
        ratio = "" if mode == "plain" else f"{ratios[mode]:.3f}"
        target = f"<= {TARGETS[mode]:.2f}" if mode in TARGETS else ""
        ok = "" if mode not in TARGETS else ("  ok" if ratios[mode] <= TARGETS[mode] else "  MISSED")
        print(f"{mode:<12} {ms[mode]:>9.1f} {100 * spread[mode]:>6.0f}% {ratio:>8} {target:>7}{ok}")
    print("(teacher_fwd: the teacher's no_grad eval-mode forward alone, part of the kd step; spread = "
          "(max - min) / median of the timed repeats; ratios = medians of per-repeat ratios)")
    if max(spread.values()) > 0.5:
        print("note: a spread above 50% means the machine was busy during the measurement; the paired "
              "ratios are steadier than the absolute times")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    t_start = time.perf_counter()

    import torch

    from pipeline import dist

    # DeepSpeed's MoE needs a process group (here of 1 rank); on CPU it tunes malloc
    ranks = dist.init(tune_allocator=args.malloc_tuning)
    malloc_tuned = torch.device("cpu") == dist.device() and args.malloc_tuning
    torch.set_num_threads(args.threads)
    m = build(args, ranks)
    times = time_modes(m, args.warmup)

    ms = {mode: 1e3 * statistics.median(v) for mode, v in times.items()}
    spread = {mode: (max(v) - min(v)) / statistics.median(v) for mode, v in times.items()}
    ratios = {mode: statistics.median(a / b for a, b in zip(times[mode], times["plain"]))
              for mode in ("kd", "after_stop", "teacher_fwd")}
    total = time.perf_counter() - t_start
    report(m, args, ms, spread, ratios)

    teacher, student = m["teacher"], m["student"]
    result = {
        "meta": {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                 "cpu_count": os.cpu_count(), "malloc_tuning": malloc_tuned, "load_avg_1m": os.getloadavg()[0],
                 "python": platform.python_version(),
                 "torch": torch.__version__, "deepspeed": __import__("deepspeed").__version__, "recipe": RECIPE,
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "total_seconds": round(total, 1)},
        "teacher": {"layers": teacher.cfg.layers, "experts": list(teacher.cfg.experts),
                    "weights": str(args.teacher_dir) if args.teacher_dir else "random"},
        "student": {"layers": student.cfg.layers, "experts": list(student.cfg.experts),
                    "kept_teacher_layers": m["kept"]},
        "tokens_per_step": m["micro"] * m["recipe"].data.seq_len,
        "median_ms": {mode: round(v, 2) for mode, v in ms.items()},
        "spread": {mode: round(v, 3) for mode, v in spread.items()},
        "ratio_to_plain": {mode: round(v, 3) for mode, v in ratios.items()},
        "targets": TARGETS,
        "meets_targets": {mode: ratios[mode] <= t for mode, t in TARGETS.items()},
        "times_s": {mode: [round(t, 5) for t in v] for mode, v in times.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "kd_step_time.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}; total {total:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
