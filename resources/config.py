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
    """The docstring written under each field of a dataclass (the convention of this codebase)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
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


def config_class(cls: type) -> type[Config]:
    """A Dagster `Config` with the scalar fields of dataclass `cls` (same names, types, defaults)."""
    hints = typing.get_type_hints(cls)
    docs = _attribute_docs(cls)
    fields = {
        f.name: (hints[f.name], Field(default=f.default, description=docs.get(f.name)))
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING
    }

    def resolve(self):  # noqa: ANN001, ANN202
        return cls(**self.model_dump())

    model = create_model(f"{cls.__name__}Settings", __base__=Config, **fields)
    model.resolve = resolve
    model.__doc__ = f"Dagster config of `{cls.__module__}.{cls.__name__}` (validated by `resolve()`)."
    return model
