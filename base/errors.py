"""The one exception type for bad user input (paths, formats, mismatched models); the CLI prints it as one line."""


class ModelError(ValueError):
    pass
