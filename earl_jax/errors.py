"""Errors the user sees by name."""


class CheckpointError(ValueError):
    """A model checkpoint (Hugging Face folder) or a training checkpoint (orbax) is missing, corrupt or does
    not match the model / optimizer it is loaded into. The message names the file or folder."""
