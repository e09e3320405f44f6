"""Zero-shot evaluation of moe-pipeline models (teacher, student, package) with lm-evaluation-harness.

    moe-pipeline eval runs/tiny                  # teacher and student on the bundled tasks -> runs/tiny/eval/
    moe-pipeline lm-eval run --model moe-pipeline --model_args path=runs/tiny/student --tasks tiny_lastword

  adapter.py         the lm-eval `LM` adapter, registered as `moe-pipeline` (its `model_args` are listed there)
  lm_eval_cli.py     `moe-pipeline lm-eval`: lm-eval's own command line with that model and the bundled tasks
  tasks.py           the bundled offline tasks, built from the held-out text (`python -m eval.tasks`)
  models.py          which models a path names (run, stage directory, package) and loading one on this rank
  jobs.py            batch jobs: every model x every task, one resumable cell at a time (`moe-pipeline eval`)
  report.py          the result tables and plot of a job (results.json, results.md, results.png)

No imports here, so importing one submodule (lm_eval_cli imports `eval.tasks`) loads only what it needs.
"""
