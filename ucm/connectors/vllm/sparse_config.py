"""The settings of sparse decode in vLLM: the `sparse` accelerator
(SparseAccelerator, ucm/accelerators/sparse/accelerator.py), switched on
by `UCM_VLLM_SPARSE`.

The switch. vLLM's processes (the front end, EngineCore, every worker)
inherit the environment variable `UCM_VLLM_SPARSE`, and the
`vllm.general_plugins` entry point (`ucm.connectors.vllm.sparse_plugin:register`)
reads it in each of them, before any config exists, to point the
attention backend at ucm's. Its value is a YAML (or JSON) mapping of the
accelerator's options, or `on` for no options of its own; unset, empty,
`off` or `false` is off (vLLM's stock backend).

The settings. The worker's backend builds the accelerator
(`sparse_accelerator`) from the ucm config the worker runs under: its
`accelerators` entry `sparse` gives the options, and the keys
`UCM_VLLM_SPARSE` names override them (or are the options, without such
an entry):

    accelerators:                       # the YAML of kv_connector_extra_config's ucm_config
      - name: sparse
        options: {selector: hybrid, budget: {tokens: 1024}, sink_tokens: 128, local_tokens: 256}

    UCM_VLLM_SPARSE=on                  # the switch; or, alone:
    UCM_VLLM_SPARSE='{selector: hybrid, budget: {tokens: 1024}, sink_tokens: 128, local_tokens: 256}'

The options are SparseOptions' (the accelerator's docstring): in vLLM,
`page_tokens` must divide vLLM's block size (128 on CPU), decode rows
whose context is shorter than `min_context_tokens` go to the stock kernel,
a row's selection is held for `reselect_every` steps (the tokens decoded
meanwhile attended too), `lowrank` and `hybrid` fit their basis of `rank`
directions per layer on the first context it decodes sparsely; the page
summaries live beside vLLM's KV blocks, so `summary_capacity_bytes` is not
read.

Bad values raise `ConfigError` naming `UCM_VLLM_SPARSE.<key>` (the
variable) or `accelerators.<i>.options.<key>` (the YAML) and what is
allowed. Pure data: no vLLM or torch import here.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import yaml
from pydantic import ValidationError

from ucm.accelerators.chain import Accelerators
from ucm.accelerators.sparse import SparseAccelerator, SparseOptions
from ucm.config.schema import AcceleratorConfig, UcmConfig
from ucm.config.validation import describe_validation_error
from ucm.errors import ConfigError

ENV_SPARSE = "UCM_VLLM_SPARSE"
_OFF = (None, False, "", "off", "0", 0)


def parse_sparse(value: Optional[str]) -> Optional[SparseOptions]:
    """The options in one value of `UCM_VLLM_SPARSE` (those it names are
    the options' `model_fields_set`); None when it says off."""
    if value is None or value.strip() == "":
        return None
    try:
        raw = yaml.safe_load(value)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        raise ConfigError(f"{ENV_SPARSE}: the value is not valid YAML: {exc}") from None
    if raw in _OFF:
        return None
    if raw is True or raw == "on" or raw == 1:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{ENV_SPARSE}: expected a mapping of {sorted(SparseOptions.model_fields)}, "
                          f"or on / off, got {value!r}")
    try:
        return SparseOptions.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, SparseOptions, prefix=f"{ENV_SPARSE}.")) from None


def sparse_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[SparseOptions]:
    """The options of this process's `UCM_VLLM_SPARSE`, or None (off)."""
    env = os.environ if environ is None else environ
    return parse_sparse(env.get(ENV_SPARSE))


def sparse_accelerator(config: UcmConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[SparseAccelerator]:
    """The process's SparseAccelerator, or None when `UCM_VLLM_SPARSE` is
    off: `config`'s `sparse` entry with the keys the variable names over
    its options (an entry of those keys alone without one), built as a
    connector builds its engine-side chain, over no cache (the backend
    reads vLLM's KV, not ucm's)."""
    env = sparse_from_env(environ)
    if env is None:
        return None
    given = {k: getattr(env, k) for k in env.model_fields_set}
    entries = list(config.accelerators)
    at = next((i for i, e in enumerate(entries) if e.name == SparseAccelerator.name), None)
    if at is None:
        entries.append(AcceleratorConfig(name=SparseAccelerator.name, options=given))
    else:
        entries[at] = AcceleratorConfig(name=SparseAccelerator.name, options={**entries[at].options, **given})
    merged = config.model_copy(update={"accelerators": tuple(entries)})
    sparse = Accelerators.build(merged, None, runs_in="engine").get(SparseAccelerator)
    if sparse is None:  # the entry point named `sparse` is another class
        raise ConfigError(f"accelerator {SparseAccelerator.name!r} is not {SparseAccelerator.__qualname__}")
    return sparse
