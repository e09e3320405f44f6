"""Run directories and stage bookkeeping.

    runs/<recipe name>/
      recipe.yaml       the resolved recipe (after --set), written once
      <stage>.partial/  a stage at work: DeepSpeed checkpoints, resumable
      <stage>/          a finished stage (renamed from .partial when complete), with DONE.json
      metrics.jsonl     one JSON object per logged step, every stage

A stage that finished is skipped on a re-run; one that was interrupted resumes from its
`.partial` directory. Only rank 0 writes these files.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import yaml

from pipeline.files import atomic_write_text, sha256_file
from pipeline.recipe import Recipe, RecipeError, diff_recipes, dump_recipe, validate


RECIPE_FILE = "recipe.yaml"


class RunDir:
    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def recipe_path(self) -> Path:
        return self.root / RECIPE_FILE

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    def stage(self, name: str) -> Path:
        return self.root / name

    def partial(self, name: str) -> Path:
        return self.root / f"{name}.partial"

    def done(self, name: str) -> dict | None:
        path = self.stage(name) / "DONE.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def check_recipe(self, recipe: Recipe, redo: bool = False) -> None:
        """Raise if this directory already holds a different recipe (unless redoing)."""
        if self.recipe_path.is_file() and not redo:
            old = validate(yaml.safe_load(self.recipe_path.read_text()))
            changes = diff_recipes(old, recipe)
            if changes:
                raise RecipeError("--run-dir", str(self.root),
                                  f"holds a run of another recipe ({'; '.join(changes[:3])}); "
                                  f"pass --run-dir for a new run, or --redo to start this one over")

    def write_recipe(self, recipe: Recipe) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        text = dump_recipe(recipe)
        if not self.recipe_path.is_file() or self.recipe_path.read_text() != text:
            atomic_write_text(self.recipe_path, text)

    def recipe_sha256(self) -> str:
        return sha256_file(self.recipe_path)

    def start(self, name: str, redo: bool = False) -> Path:
        """The working directory of a stage; a redo clears the finished and partial ones."""
        if redo:
            for d in (self.stage(name), self.partial(name)):
                if d.exists():
                    shutil.rmtree(d)
            self.truncate_metrics(name, after_step=-1)
        self.partial(name).mkdir(parents=True, exist_ok=True)
        return self.partial(name)

    def finish(self, name: str, info: dict) -> Path:
        """Write DONE.json (with every file's size) into the partial directory and rename it into place."""
        work, final = self.partial(name), self.stage(name)
        files = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
        info = {"stage": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **info,
                "outputs": {f: (work / f).stat().st_size for f in files}}
        atomic_write_text(work / "DONE.json", json.dumps(info, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(work, final)
        return final

    def log(self, record: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate_metrics(self, stage: str, after_step: int) -> None:
        """Drop a stage's records past `after_step` (a resumed run logs those steps again)."""
        if not self.metrics_path.is_file():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill mid-write
                continue
            if not (rec.get("stage") == stage and rec.get("step", -1) > after_step):
                keep.append(line)
        atomic_write_text(self.metrics_path, "".join(k + "\n" for k in keep))
