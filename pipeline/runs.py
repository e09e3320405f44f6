"""Run directories and stage bookkeeping.

    runs/<recipe name>/
      recipe.yaml       the resolved recipe (after --set), written once
      <stage>.partial/  a stage at work: DeepSpeed checkpoints, resumable
      <stage>/          a finished stage (renamed from .partial when complete), with DONE.json
      metrics.jsonl     one JSON object per logged step, every stage
      metrics.png       the training curves drawn from it (loss, held-out loss, KD beta), redrawn as each stage ends

A stage that finished is skipped on a re-run; one that was interrupted resumes from its
`.partial` directory. Only rank 0 writes these files.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path


from pipeline.artifacts import DONE, METRICS, METRICS_PLOT, RECIPE_FILE, atomic_write_text, sha256_file
from pipeline.dist import Ranks, barrier
from pipeline.recipe import Recipe, RecipeError, diff_recipes, dump_recipe, load_stored_recipe


class RunDir:
    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def recipe_path(self) -> Path:
        return self.root / RECIPE_FILE

    @property
    def metrics_path(self) -> Path:
        return self.root / METRICS

    def stage(self, name: str) -> Path:
        return self.root / name

    def partial(self, name: str) -> Path:
        return self.root / f"{name}.partial"

    def done(self, name: str) -> dict | None:
        path = self.stage(name) / DONE
        return json.loads(path.read_text()) if path.is_file() else None

    def check_recipe(self, recipe: Recipe, redo: bool = False) -> None:
        """Raise if this directory already holds a different recipe (unless redoing)."""
        if self.recipe_path.is_file() and not redo:
            old = load_stored_recipe(self.recipe_path)
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

    def skip(self, name: str, ranks: Ranks, redo: bool, again: str) -> bool:
        """Whether stage `name` is done and not to be redone (rank 0 says so, and how to `again`)."""
        if not self.done(name) or redo:
            return False
        if ranks.rank == 0:
            print(f"[{name}] already done: {self.stage(name)} (pass --redo to {again})", flush=True)
        return True

    def open(self, name: str, ranks: Ranks, redo: bool = False) -> Path:
        """Collective: stage `name`'s working directory, started by rank 0 (a redo clears it), on storage every rank
        shares and at the world size it started with (`check_world_size`)."""
        if ranks.rank == 0:
            self.start(name, redo)
        barrier()
        work = self.partial(name)
        check_world_size(work, ranks)
        return work

    def finish(self, name: str, info: dict) -> Path:
        """Write DONE.json (with every file's size) into the partial directory and rename it into place."""
        work, final = self.partial(name), self.stage(name)
        files = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
        info = {"stage": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **info,
                "outputs": {f: (work / f).stat().st_size for f in files}}
        atomic_write_text(work / DONE, json.dumps(info, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(work, final)
        try:  # the curves are a view of metrics.jsonl: a plotting failure must not fail a finished stage
            plot_metrics(self.metrics_path, self.root / METRICS_PLOT)
        except Exception as err:  # noqa: BLE001
            print(f"[{name}] warning: {self.root / METRICS_PLOT} not drawn: {type(err).__name__}: {err}", flush=True)
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


def check_shared_storage(work: Path, ranks: Ranks) -> None:
    """Every rank must see the others' files in `work`: each writes its expert checkpoints and weight shards there,
    rank 0 reads every shard to index them, and a resume reads every rank's checkpoint files. A run directory on a
    node's own disk is refused here, on every rank, before any training (RecipeError naming --run-dir). Collective."""
    import socket

    from pipeline.dist import gather_numbers

    if ranks.world == 1:
        return
    probes = work / ".ranks"
    if ranks.rank == 0:  # no file of an earlier run may stand in for a rank that cannot write here
        shutil.rmtree(probes, ignore_errors=True)
    barrier()
    probes.mkdir(parents=True, exist_ok=True)
    (probes / f"{ranks.rank}").write_text(socket.gethostname())
    barrier()
    missing = [r for r in range(ranks.world) if not (probes / str(r)).is_file()]
    seen = gather_numbers([float(len(missing))])
    barrier()
    if ranks.rank == 0:
        shutil.rmtree(probes, ignore_errors=True)
    if any(n[0] for n in seen):
        blind = [r for r, n in enumerate(seen) if n[0]]
        raise RecipeError("--run-dir", str(work.parent), f"on storage every rank shares: rank(s) {blind} do not see "
                          f"every rank's files in {work} (a node's own disk?); DeepSpeed's checkpoints and the "
                          f"weight shards are written by each rank and read by the others")


def check_world_size(work: Path, ranks: Ranks) -> None:
    """A stage resumes only at the world size it started with (its checkpoints are split that way); and its
    directory must be on storage every rank shares (`check_shared_storage`)."""
    check_shared_storage(work, ranks)
    path = work / "world_size"
    if path.is_file() and int(path.read_text()) != ranks.world:
        started = int(path.read_text())
        raise RecipeError("--nproc", ranks.world, f"{work} was started with {started} ranks and resumes only with "
                          f"--nproc {started}; or pass --redo to start over")
    barrier()
    if ranks.rank == 0:
        atomic_write_text(path, str(ranks.world))


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (a line torn by a kill mid-write is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_metrics(metrics: Path, out: Path) -> Path | None:
    """Training curves of every stage in `metrics` (metrics.jsonl) as one PNG, over the tokens each stage trained
    on (over steps for records without a token count): training loss (CE for a student) with KD's beta on a second
    y-axis, so the staged stop shows, and held-out loss (with the teacher's next to a student's)."""
    records = read_metrics(metrics)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(dict.fromkeys(r["stage"] for r in records if "stage" in r))
    by_tokens = all("tokens" in r for r in records if "loss" in r or "val_loss" in r)

    def x(r: dict) -> float:
        return r["tokens"] / 1e6 if by_tokens else r["step"]

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(9.5, 3.4), dpi=90)
    ax_beta = None
    for i, stage in enumerate(stages):
        rows = [r for r in records if r.get("stage") == stage]
        train = [(x(r), r.get("lm_loss", r.get("loss"))) for r in rows if "loss" in r]
        val = [(x(r), r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            ax_train.plot(*zip(*train), color=f"C{i}", lw=1, label=stage)
        if val:
            ax_val.plot(*zip(*val), "o-", color=f"C{i}", ms=3, label=stage)
        teacher = [(x(r), r["teacher_val_loss"]) for r in rows if "teacher_val_loss" in r]
        if teacher:
            ax_val.plot(*zip(*teacher), "--", color="gray", lw=1, label=f"teacher (during {stage})")
        beta = [(x(r), r["beta"]) for r in rows if "beta" in r and "loss" in r]
        if beta:
            ax_beta = ax_beta or ax_train.twinx()
            ax_beta.step(*zip(*beta), where="post", color=f"C{i}", ls=":", lw=1.5, label=f"beta ({stage})")
    xlabel = "tokens trained (M)" if by_tokens else "step"
    ax_train.set(title="training loss (CE)", xlabel=xlabel, ylabel="nats/token")
    ax_val.set(title="held-out loss", xlabel=xlabel, ylabel="nats/token")
    ax_train.legend(fontsize=7, loc="upper center")
    if ax_beta is not None:
        ax_beta.set_ylabel("KD weight beta (dotted)", fontsize=7)
        ax_beta.set_ylim(-0.05, max(1.05, ax_beta.get_ylim()[1]))
        ax_beta.legend(fontsize=7, loc="upper right")
        ax_beta.tick_params(labelsize=7)
    ax_val.legend(fontsize=7)
    for ax in (ax_train, ax_val):
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{Path(metrics).parent.name}: training", fontsize=9)
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out
