"""Errors of model loading, in a module of their own so that every loader can raise
them without importing another loader."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""
