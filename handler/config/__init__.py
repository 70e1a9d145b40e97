"""Configuration: serving.properties and environment overrides -> one ServingConfig.

properties.py parses and resolves; explain.py prints the KV arithmetic (`config --explain`).
"""
from handler.config.properties import (ENV_ALIASES, IGNORED_KEYS, KNOWN_KEYS, TYPED_KEYS, ConfigError,
                                       PropertiesSyntaxError, ServingConfig, check_tp_heads, config_to_dict,
                                       cpu_cores, load_config, main, parse_properties)

__all__ = ["ENV_ALIASES", "IGNORED_KEYS", "KNOWN_KEYS", "TYPED_KEYS", "ConfigError", "PropertiesSyntaxError",
           "ServingConfig", "check_tp_heads", "config_to_dict", "cpu_cores", "load_config", "main",
           "parse_properties"]
