"""The one error type for bad user input: it names the field and the fix."""


class ConfigError(ValueError):
    """Invalid user input. ``field`` is the dotted config key (or file/tensor) at fault."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
