"""lm-eval's own command line with our model and the bundled tasks: `moe-pipeline lm-eval ARGS`.

    moe-pipeline lm-eval run --model moe-pipeline --model_args path=runs/tiny/student --tasks tiny_lastword
    moe-pipeline lm-eval ls tasks                    # lm-eval's tasks and ours (tiny_bundled)

ARGS are `lm-eval`'s own (lm-eval 0.4.13: `run`, `ls`, `validate`). lm-eval discovers no model plugins in this
release (entry-point discovery is not released), so this command does for one process what registering does in
the harness's documentation: it adds "moe-pipeline" to lm-eval's model registry (lazily, as
"eval.adapter:MoEPipelineLM": torch and the adapter load only when the model is used), puts the bundled tasks'
folder first on `--include_path` (a path you give comes after it, so your tasks override ours), then runs lm-eval's
command line. Nothing runs at interpreter start and nothing is installed into lm-eval.

From Python:

    from eval.lm_eval_cli import register
    from eval.tasks import bundled_task_dir
    import lm_eval
    from lm_eval.tasks import TaskManager

    register()
    lm_eval.simple_evaluate(model="moe-pipeline", model_args="path=runs/tiny/student", tasks=["tiny_lastword"],
                            task_manager=TaskManager(include_path=str(bundled_task_dir())))
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

MODEL_NAME = "moe-pipeline"
MODEL_TARGET = "eval.adapter:MoEPipelineLM"  # lazy: imported by lm-eval's get_model("moe-pipeline")


def register() -> None:
    """Add "moe-pipeline" to lm-eval's model registry, as a lazy target (idempotent; an already imported
    `eval.adapter` has registered the class itself). The registry is then not empty, which stops lm-eval's
    `get_model` from importing its own model names, so they are imported here (placeholders, no model code)."""
    import lm_eval.api.registry as registry

    if MODEL_NAME not in registry.model_registry:
        registry.model_registry.register(MODEL_NAME, target=MODEL_TARGET)
    import lm_eval.models  # noqa: F401


def include_paths(given: str | list | None, config: str | None = None) -> list[str]:
    """The bundled tasks' folder, then the include path given on the command line (or, without one, in the
    `--config` YAML), not repeating the bundled folder."""
    from pathlib import Path

    from eval.tasks import bundled_task_dir

    if given is None and config:
        from lm_eval.config.evaluate_config import EvaluatorConfig

        given = EvaluatorConfig.load_yaml_config(config).get("include_path")
    bundled = Path(bundled_task_dir()).resolve()
    rest = [] if given is None else [str(p) for p in (given if isinstance(given, (list, tuple)) else [given])]
    return [str(bundled), *(p for p in rest if Path(p).resolve() != bundled)]


def main(argv: Sequence[str] | None = None) -> int:
    """`moe-pipeline lm-eval ARGS`: lm-eval's command line (lm_eval.__main__.cli_evaluate) on ARGS, with
    `register()` done and the bundled tasks on the include path of the subcommands that take one."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    register()
    setup_logging()
    cli = HarnessCLI()
    saved, sys.argv = sys.argv, ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:  # HarnessCLI.parse_args reads sys.argv (it inserts `run` for the legacy flag-only form)
        args = cli.parse_args()
    finally:
        sys.argv = saved
    if hasattr(args, "include_path"):
        args.include_path = include_paths(args.include_path, getattr(args, "config", None))
    cli.execute(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
