"""Exceptions of the torch layer that more than one module raises."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message says why and what to do."""
