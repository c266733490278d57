"""The one YAML file: its typed schema (schema.py), size strings (sizes.py)
and the validation messages every plugin's options share (validation.py).

`load_config(path | mapping | None)` reads, overrides from `UCM_*` and
validates; errors are `ConfigError`s naming the key and the allowed values.
"""
from ucm.config.schema import (AcceleratorConfig, HeatConfig, PolicyConfig, ServiceConfig, TierConfig, UcmConfig,
                               adapter_options, load_config)
from ucm.config.sizes import format_size, parse_size

__all__ = ["AcceleratorConfig", "HeatConfig", "PolicyConfig", "ServiceConfig", "TierConfig", "UcmConfig",
           "adapter_options", "format_size", "load_config", "parse_size"]
