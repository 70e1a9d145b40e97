"""Configuration: serving.properties and environment overrides -> one ServingConfig.

schema.py declares every key (parser, default, aliases, docs); properties.py parses and resolves;
switches.py declares the LMI_* environment switches; sizing.py holds the sizing rules (geometry,
dtype, device, KV pool, batch width) and hardware.py asks the machine for them; explain.py prints
the KV arithmetic (`config --explain`); docs.py renders the reference tables from the declarations.
"""
from handler.config.properties import (ENV_ALIASES, IGNORED_KEYS, KNOWN_KEYS, TYPED_KEYS, ConfigError,
                                       PropertiesSyntaxError, ServingConfig, check_tp_heads, config_to_dict,
                                       cpu_cores, load_config, main, parse_properties)

__all__ = ["ENV_ALIASES", "IGNORED_KEYS", "KNOWN_KEYS", "TYPED_KEYS", "ConfigError", "PropertiesSyntaxError",
           "ServingConfig", "check_tp_heads", "config_to_dict", "cpu_cores", "load_config", "main",
           "parse_properties"]
