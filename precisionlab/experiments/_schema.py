"""The declarative schema of experiment files: re-exported from :mod:`precisionlab._schema`
(the ground floor), where the train config, the survey and the memory experiment use it too."""

from precisionlab._schema import REQUIRED, ConfigError, Field, coerce, describe_type, validate_table

__all__ = ["REQUIRED", "ConfigError", "Field", "coerce", "describe_type", "validate_table"]
