"""The run configuration: the schema (:mod:`.schema`: one frozen dataclass per section, every
key's default and check) and reading it (:mod:`.load`: YAML presets with ``base:`` inheritance,
``key=value`` overrides, validation, the way back to YAML). ``load`` imports ``schema``; nothing
imports back, so the package has no import cycle."""

from cluster_fl.config.checks import ConfigError
from cluster_fl.config.load import (build_config, dump_config, load_config, override,
                                    parse_override, require_resolved, to_dict, valid_keys,
                                    yaml_load)
from cluster_fl.config.schema import (CLIPPING_METHODS, COMPONENTS, INSIDE_POOL_RULES, SECTIONS,
                                      AggregationConfig, AuditConfig, ClientConfig, Config,
                                      DataConfig, EvalConfig, FLConfig, ModelConfig,
                                      PretrainConfig, PrivacyConfig, RunConfig)

__all__ = [
    "CLIPPING_METHODS", "COMPONENTS", "INSIDE_POOL_RULES", "SECTIONS", "AggregationConfig",
    "AuditConfig", "ClientConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "FLConfig",
    "ModelConfig", "PretrainConfig", "PrivacyConfig", "RunConfig", "build_config", "dump_config",
    "load_config", "override", "parse_override", "require_resolved", "to_dict", "valid_keys", "yaml_load",
]
