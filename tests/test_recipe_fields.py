"""Every recipe field is read somewhere: a key no code reads would be a setting that silently does nothing.

A field `f` of a section `S` counts as read where the code takes `.f` of an expression known to be an `S`:
a chain from a recipe (`recipe.teacher.train.lr`, `self.recipe.kd`), a name bound to one (`m = recipe.model`),
a parameter annotated with the section (`train: TrainSpec`), or `self` in the section's own methods. Matching
the bare name would not do: `.layers` and `.dropout` are read off ModelConfig too. In pipeline/recipe.py the
derived facts count (`Recipe.kd_stop_step` reads `kd.stop_at` for its callers), the validators do not: they
only check a field.
"""

from __future__ import annotations

import ast
import typing

import pytest
from pydantic import BaseModel

from conftest import ROOT
from pipeline.recipe import Recipe, Section

SOURCE_DIRS = ("pipeline", "distill", "eval", "export")
RECIPE_MODULE = ROOT / "pipeline" / "recipe.py"


def _classes_in(annotation) -> list[type]:
    found = [annotation] if isinstance(annotation, type) else []
    for arg in typing.get_args(annotation):
        found += _classes_in(arg)
    return found


def schema(cls: type[BaseModel] = Recipe, out: dict | None = None) -> dict[type, dict[str, type]]:
    """Each section class reachable from Recipe -> {field name: section class of that field, if it is one}."""
    out = {} if out is None else out
    out[cls] = {}
    for name, field in cls.model_fields.items():
        for sub in _classes_in(field.annotation):
            if issubclass(sub, BaseModel):
                out[cls][name] = sub
                if sub not in out:
                    schema(sub, out)
    return out


SCHEMA = schema()
BY_NAME = {cls.__name__: cls for cls in SCHEMA}


def _annotated_section(annotation: ast.expr | None) -> type | None:
    """The section named in an annotation (`TrainSpec`, `KDSpec | None`, `"Recipe"`), if any."""
    for node in ast.walk(annotation) if annotation is not None else ():
        name = node.id if isinstance(node, ast.Name) else node.value if isinstance(node, ast.Constant) else None
        if isinstance(name, str) and name in BY_NAME:
            return BY_NAME[name]
    return None


def _section_of(node: ast.expr, env: dict[str, type]) -> type | None:
    """The section an expression evaluates to, as far as names and annotations tell."""
    if isinstance(node, ast.Name):
        return env.get(node.id) or (Recipe if node.id == "recipe" else None)
    if isinstance(node, ast.Attribute):
        parent = _section_of(node.value, env)
        if parent is not None:
            return SCHEMA[parent].get(node.attr)
        return Recipe if node.attr == "recipe" else None  # self.recipe, run.recipe
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in ("load_recipe", "validate"):
            return Recipe
        return BY_NAME.get(node.func.id)  # DataSpec(...)
    return None


def _is_validator(fn: ast.AST) -> bool:
    return any("validator" in ast.unparse(d) for d in getattr(fn, "decorator_list", ()))


def _reads_in(tree: ast.Module, skip_validators: bool) -> set[tuple[type, str]]:
    reads: set[tuple[type, str]] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    methods_of = {id(fn): BY_NAME[c.name] for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in BY_NAME
                  for fn in c.body if isinstance(fn, ast.FunctionDef)}  # a section's own methods: self is one
    for scope in [tree, *functions]:
        if skip_validators and _is_validator(scope):
            continue
        env: dict[str, type] = {"self": methods_of[id(scope)]} if id(scope) in methods_of else {}
        if not isinstance(scope, ast.Module):
            args = scope.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if (cls := _annotated_section(arg.annotation)) is not None:
                    env[arg.arg] = cls
        for _ in range(3):  # a name bound from another bound name: a few passes settle it
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    if (cls := _section_of(node.value, env)) is not None:
                        env[node.targets[0].id] = cls
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if (cls := _annotated_section(node.annotation)) is not None:
                        env[node.target.id] = cls
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                cls = _section_of(node.value, env)
                if cls is not None and node.attr in cls.model_fields:
                    reads.add((cls, node.attr))
    return reads


def field_reads() -> set[tuple[type, str]]:
    reads: set[tuple[type, str]] = set()
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            reads |= _reads_in(ast.parse(path.read_text(), str(path)), skip_validators=path == RECIPE_MODULE)
    return reads


def test_the_schema_walk_reaches_every_section():
    def subclasses(cls):
        return {s for sub in cls.__subclasses__() for s in {sub} | subclasses(sub)}
    assert set(SCHEMA) == subclasses(Section)


def test_every_recipe_field_is_read_somewhere():
    reads = field_reads()
    unread = [f"{cls.__name__}.{name}" for cls in SCHEMA for name in cls.model_fields if (cls, name) not in reads]
    assert not unread, (f"recipe fields nothing in {', '.join(SOURCE_DIRS)} reads (a setting that does nothing): "
                        f"{unread}; use them or drop them from pipeline/recipe.py")


@pytest.mark.parametrize("code, read", [
    ("def f(recipe):\n    return recipe.teacher.train.lr", True),
    ("def f(self):\n    return self.recipe.kd.beta", True),
    ("def f(recipe):\n    m = recipe.model\n    return m.dropout", True),
    ("def f(train: TrainSpec):\n    return train.lr", True),
    ("def f(cfg):\n    return cfg.dropout", False),  # a ModelConfig, not the recipe's model section
    ("def f(recipe):\n    recipe.kd.beta = 2", False),  # a store, not a read
    ("class KDSpec:\n    def f(self):\n        return self.beta", True),
    ("class KDSpec:\n    @model_validator(mode='after')\n    def f(self):\n        return self.beta", False),
])
def test_what_counts_as_a_read(code, read):
    field = {"lr": (BY_NAME["TrainSpec"], "lr"), "beta": (BY_NAME["KDSpec"], "beta"),
             "dropout": (BY_NAME["ModelSpec"], "dropout")}
    found = _reads_in(ast.parse(code), skip_validators=True)
    assert (next(v for k, v in field.items() if k in code) in found) == read
