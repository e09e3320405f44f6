"""Make lm-eval's own CLI see our model and our bundled tasks, with no flags and no plugin API.

    lm-eval run --model moe-pipeline --model_args path=runs/tiny/student --tasks tiny_lastword

lm-eval 0.4.13 has no entry-point discovery for models (upstream PR #4013 is not released) and its
`TaskManager` only scans `lm_eval/tasks` plus `--include_path`. So this module patches the two
places in-process, the moment lm-eval itself loads them:

  * `lm_eval.api.registry` (right after it executes): `model_registry` gets "moe-pipeline" as the
    LAZY target "eval.adapter:MoEPipelineLM" (a "module:attr" placeholder, materialised by
    `get_model`; `@register_model` in eval/adapter.py then upgrades it to the class). Registering
    makes the registry non-empty, which stops `get_model` from importing `lm_eval.models` (the
    built-in names) by itself, so `lm_eval.models` (a dict of placeholders, cheap) is imported too.
  * `lm_eval.tasks.manager` (right after it executes): `TaskManager.__init__` is wrapped to add
    `eval.tasks.bundled_task_dir()` to `include_path`, computed when a TaskManager is built (not
    before), placed before the caller's own paths so those still override ours, also with
    `include_defaults=False`. If eval.tasks fails, a warning is issued and the TaskManager is built
    without it.

How it gets into every process: the wheel / editable install puts `moe_pipeline_lm_eval.pth` in
site-packages (see setup.py). Its one `import` line loads THIS FILE by path, under the private
name `_moe_pipeline_lm_eval_plugin` (so the top-level `eval` package is not imported at start-up:
no cost, and no shadowing of somebody's own `eval.py`), and calls `install()`, which only puts a
`sys.meta_path` finder in front. The finder ignores every import but the two modules above, so a
process that never imports lm_eval pays one set lookup per import and imports neither lm_eval nor
torch. Everything is wrapped: a failure is at most a warning, never a broken interpreter.

Explicit use (our own code, or a process started with `python -S`): `register()`.
Opt out for one process: `MOE_PIPELINE_LM_EVAL_PLUGIN=0`.
Only stdlib imports at module level: this file runs at interpreter start.
"""

from __future__ import annotations

import os
import sys

MODEL_NAME = "moe-pipeline"
MODEL_TARGET = "eval.adapter:MoEPipelineLM"  # lazy: never imported here
REGISTRY_MODULE = "lm_eval.api.registry"
TASKS_MODULE = "lm_eval.tasks.manager"  # where TaskManager is defined (lm_eval.tasks re-exports it)
PTH_NAME = "moe_pipeline_lm_eval.pth"
ENV_SWITCH = "MOE_PIPELINE_LM_EVAL_PLUGIN"
_MARK = "_moe_pipeline_plugin"  # attribute marking our finder / our TaskManager wrapper (idempotence)

# The .pth line (written by setup.py). Loads this file by path without importing the `eval`
# package; silent when `eval` is not ours (no lm_eval_plugin.py beside it), a warning on error.
PTH_LINE = (
    "import sys; exec(" + repr(
        "def _moe_pipeline_lm_eval_boot():\n"
        "    import os, sys\n"
        "    from importlib.util import find_spec, module_from_spec, spec_from_file_location\n"
        "    spec = find_spec('eval')\n"
        "    dirs = list(getattr(spec, 'submodule_search_locations', None) or ())\n"
        "    path = dirs and os.path.join(dirs[0], 'lm_eval_plugin.py')\n"
        "    if not path or not os.path.isfile(path):\n"
        "        return\n"
        "    spec = spec_from_file_location('_moe_pipeline_lm_eval_plugin', path)\n"
        "    mod = module_from_spec(spec)\n"
        "    sys.modules[spec.name] = mod\n"
        "    spec.loader.exec_module(mod)\n"
        "    mod.install()\n"
        "try:\n"
        "    _moe_pipeline_lm_eval_boot()\n"
        "except Exception as exc:\n"
        "    try:\n"
        "        import warnings\n"
        "        warnings.warn(f'moe-pipeline: lm-eval plugin not loaded at start-up: {exc!r}')\n"
        "    except Exception:\n"
        "        pass\n"
    ) + ", {'__name__': '_moe_pipeline_lm_eval_pth'})\n"
)


def _warn(msg: str) -> None:
    try:
        import warnings

        warnings.warn(f"moe-pipeline: {msg}", RuntimeWarning, stacklevel=3)
    except Exception:  # -W error at start-up must not break anything either
        pass


def _enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


# ---------------------------------------------------------------- the two patches


def _register_model(registry_module) -> None:
    """Add the lazy "moe-pipeline" entry (idempotent; keeps an already materialised class)."""
    registry = registry_module.model_registry
    if MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=MODEL_TARGET)
    # a non-empty registry no longer makes get_model() import the built-in names: do it here
    if "lm_eval.models" not in sys.modules:
        import lm_eval.models  # noqa: F401  (lm_eval's own lazy placeholders, no model code)


def _bundled_task_dir():
    """eval.tasks.bundled_task_dir(), or None (with a warning) if it cannot be produced."""
    try:
        from eval.tasks import bundled_task_dir

        return bundled_task_dir()
    except Exception as exc:
        _warn(f"bundled lm-eval tasks unavailable (eval.tasks.bundled_task_dir() failed: {exc!r}); "
              "TaskManager built without them")
        return None


def _with_bundled(include_path):
    """include_path with the bundled task dir in front (unless already there); unchanged if none."""
    from pathlib import Path

    extra = _bundled_task_dir()
    if extra is None:
        return include_path
    paths = [] if include_path is None else (
        list(include_path) if isinstance(include_path, (list, tuple)) else [include_path])

    def same(p) -> bool:
        try:
            return Path(p).resolve() == Path(extra).resolve()
        except Exception:
            return False

    if any(same(p) for p in paths):
        return include_path
    return [str(extra), *paths]  # first: the caller's paths come later and override ours


def _patch_task_manager(manager_module) -> None:
    """Wrap TaskManager.__init__ so every TaskManager also indexes the bundled tasks (idempotent)."""
    import functools
    import inspect

    cls = manager_module.TaskManager
    original = cls.__init__
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)
    if "include_path" not in signature.parameters:
        _warn(f"{cls.__module__}.TaskManager.__init__ has no include_path; bundled tasks not added")
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["include_path"] = _with_bundled(bound.arguments.get("include_path"))
            args, kwargs = bound.args[1:], bound.kwargs
        except Exception as exc:  # never stand between lm-eval and its TaskManager
            _warn(f"could not add the bundled tasks to TaskManager: {exc!r}")
        original(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


_HOOKS = {REGISTRY_MODULE: _register_model, TASKS_MODULE: _patch_task_manager}


def _run_hook(name: str, module) -> None:
    try:
        _HOOKS[name](module)
    except Exception as exc:
        _warn(f"lm-eval plugin hook for {name} failed: {exc!r}")


# ---------------------------------------------------------------- the import hook


class _PostImportLoader:
    """Delegates to the real loader; runs our hook once the module has executed."""

    def __init__(self, loader, finder) -> None:
        self._loader = loader
        self._finder = finder

    def __getattr__(self, name):  # get_source, get_filename, is_package, resource readers ...
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        # look like a normal import afterwards (linecache, inspect, importlib.reload)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)  # an error here propagates: lm-eval's own import failed
        self._finder._done(module.__name__)
        _run_hook(module.__name__, module)


class _PostImportFinder:
    """A meta-path finder that only answers for the hooked lm_eval modules, by wrapping the spec
    the rest of sys.meta_path finds. Removes itself once both hooks have run."""

    def __init__(self, names) -> None:
        self._pending = set(names)
        setattr(self, _MARK, True)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._pending:  # the whole cost for every other import
            return None
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or getattr(finder, _MARK, False) or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
            if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None  # let the normal machinery handle it, unhooked
            spec.loader = _PostImportLoader(spec.loader, self)
            return spec
        except Exception as exc:
            _warn(f"lm-eval plugin finder failed for {fullname}: {exc!r}")
            return None

    def _done(self, name: str) -> None:
        self._pending.discard(name)
        if not self._pending:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass

    def invalidate_caches(self) -> None:
        pass


def install(*, force: bool = False) -> bool:
    """Hook lm-eval (cheap, idempotent; what the .pth calls at start-up): modules already imported
    are patched now, the others when they are imported. False if switched off (`force` overrides
    the switch) or failed (with a warning)."""
    try:
        if not (force or _enabled()):
            return False
        pending = []
        for name in _HOOKS:
            module = sys.modules.get(name)
            spec = getattr(module, "__spec__", None)
            if module is not None and not getattr(spec, "_initializing", False):
                _run_hook(name, module)
            else:
                pending.append(name)
        if pending and not any(getattr(f, _MARK, False) for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder(pending))
        return True
    except Exception as exc:
        _warn(f"lm-eval plugin not installed: {exc!r}")
        return False


def register() -> None:
    """Register with lm-eval now, explicitly (also with the switch off, or without the .pth):
    imports `lm_eval.api.registry` (stdlib only, no torch) and adds "moe-pipeline"; TaskManager is
    patched now if `lm_eval.tasks` is loaded, else when it is. Idempotent. Raises if the model
    cannot be registered (e.g. a frozen registry)."""
    install(force=True)
    import lm_eval.api.registry as registry_module

    _register_model(registry_module)
