"""The training commands: prepare (the data cache), teacher and distill (the stages), plan (sizes, or candidate
students measured)."""

from __future__ import annotations

import json
from pathlib import Path

from cli.common import LAUNCH_MODULE, strip_nproc
from pipeline.recipe import RecipeError, load_recipe


def cmd_prepare(args) -> int:
    import time

    from pipeline.artifacts import cache_root
    from pipeline.data import prepare_data

    recipe = load_recipe(args.recipe, args.overrides)
    t0 = time.perf_counter()
    try:
        data = prepare_data(recipe.data, cache_root())
    except ValueError as err:  # data errors name their recipe key
        raise RecipeError.from_message(str(err)) from None
    splits = data.meta["splits"]
    print(f"[prepare] {data.cache_dir}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} "
          f"tokens in {len(splits['train']['shard_tokens'])} part(s), vocabulary {data.vocab_size:,} "
          f"({time.perf_counter() - t0:.1f}s)")
    return 0


def cmd_plan(args) -> int:
    from distill.plan import format_plan, plan

    recipe = load_recipe(args.recipe, args.overrides, world_size=args.world_size)
    if args.measure:
        from distill.measure import run

        run_dir = args.run_dir or Path("runs") / recipe.name
        run(recipe, run_dir, args.out or run_dir / "plan", args.blocks, args.json)
        return 0
    world = args.world_size or recipe.distributed.nproc
    try:
        result = plan(recipe, world)
    except ValueError as err:
        raise RecipeError("--world-size", world, str(err)) from None
    print(json.dumps(result) if args.json else format_plan(result, world))
    return 0


def cmd_stages(args, argv: list[str]) -> int:
    """`teacher` runs the teacher stage; `distill` runs it (skipped when done) and then the student stage."""
    from pipeline import dist
    from pipeline.teacher import check_hardware

    running = dist.launched_world()  # started by a launcher (DeepSpeed's, mpirun, srun): its ranks
    if running is not None and args.nproc not in (None, running):
        raise RecipeError("--nproc", args.nproc, f"the launcher started {running} ranks: drop --nproc, "
                          f"or launch {args.nproc}")
    # world size: the running ranks, else --nproc, else the recipe's distributed.nproc
    recipe = load_recipe(args.recipe, args.overrides, world_size=running or args.nproc)
    check_hardware(recipe)
    nproc = args.nproc or recipe.distributed.nproc
    if running is None and nproc > 1:  # validated above, so errors show once, not on every rank
        return dist.relaunch(nproc, LAUNCH_MODULE, strip_nproc(argv))

    from pipeline.runs import RunDir
    from pipeline.teacher import run_teacher

    ranks = dist.init()
    run = RunDir(args.run_dir or Path("runs") / recipe.name)
    if args.command == "teacher":
        run_teacher(recipe, run, ranks, redo=args.redo)
    else:
        from distill.stage import run_student

        run_teacher(recipe, run, ranks)
        run_student(recipe, run, ranks, redo=args.redo)
    return 0
