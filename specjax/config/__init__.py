"""specjax's one config system: frozen dataclasses <-> YAML <-> command-line overrides.

    machinery   from_dict / to_dict / to_yaml / merge / apply_overrides, ConfigError (any dataclass)
    files       load_yaml / load_yaml_dict, the packaged configs (available_configs, packaged_config_path)
    schema      ModelConfig, SamplingParams, SpeculativeConfig, BackendConfig, RunConfig, load_run_config

Every public name is re-exported here, so `from specjax.config import X` is the one import to use.
"""
from specjax.config import files, machinery, schema
from specjax.config.files import available_configs, load_yaml, load_yaml_dict, packaged_config_path
from specjax.config.machinery import (
    ConfigError,
    apply_overrides,
    did_you_mean,
    from_dict,
    merge,
    to_dict,
    to_yaml,
)
from specjax.config.schema import (
    SPECULATIVE_METHODS,
    BackendConfig,
    ModelConfig,
    RunConfig,
    SamplingParams,
    SpeculativeConfig,
    load_run_config,
)

__all__ = [*machinery.__all__, *files.__all__, *schema.__all__]
