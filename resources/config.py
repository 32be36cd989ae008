"""Dagster config classes generated from the library's frozen dataclasses: one definition per
setting. Field names, types, defaults and descriptions (the attribute docstrings) come from the
dataclass; `resolve()` builds the validated library object."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from dagster import Config
from pydantic import Field, create_model


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (the convention of this codebase);
    none where the source is not available (an installation without .py files)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body
    docs = {}
    for field, doc in zip(body, body[1:], strict=False):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def config_class(cls: type, name: str, module: str) -> type[Config]:
    """A Dagster `Config` named `module.name` with the fields of dataclass `cls` (same names, types,
    defaults). Every field needs a plain default: a config without one could not `resolve()`."""
    hints = typing.get_type_hints(cls)
    docs = _attribute_docs(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no plain default; config_class cannot map it")
        fields[f.name] = (hints[f.name], Field(default=f.default, description=docs.get(f.name)))

    def resolve(self):  # noqa: ANN001, ANN202
        return cls(**self.model_dump())

    model = create_model(name, __base__=Config, __module__=module, **fields)
    model.__qualname__ = name  # importable by name: picklable like a hand-written class
    model.resolve = resolve
    model.__doc__ = f"Dagster config of `{cls.__module__}.{cls.__name__}` (validated by `resolve()`)."
    return model
