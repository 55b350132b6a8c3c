"""The one exception a user of qwentitan.modeling can cause."""


class ModelingError(ValueError):
    """A flavor, config or path the user asked for cannot be honoured; the message names the fix."""
