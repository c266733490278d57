"""Validation messages shared by the config file and every plugin's options
(adapters, policies, accelerators, the vLLM sparse config): one line per
error, naming the key and what is allowed. A leaf: it imports no registry,
so a registry may import it without a cycle."""
from __future__ import annotations

from typing import Any, Optional, get_args

from pydantic import BaseModel, ValidationError


def _allowed_keys(model: type[BaseModel], loc: tuple) -> Optional[list[str]]:
    """Field names of the model found at `loc` inside `model`."""
    cur: Any = model
    for part in loc:
        if isinstance(part, int):
            args = get_args(cur)
            cur = args[0] if args else cur
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return None
        cur = cur.model_fields[part].annotation  # a tuple's element type is taken at the next int part
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return sorted(cur.model_fields)
    return None


def describe_validation_error(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per error of `exc`, each naming the key (after `prefix`)
    and what is allowed."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1])
            lines.append(f"{key}: unknown key; allowed: {allowed}")
        elif err["type"] == "missing":
            lines.append(f"{key}: required key is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {msg} (got {err.get('input')!r})" if "got" not in msg else f"{key}: {msg}")
    return "; ".join(lines)
