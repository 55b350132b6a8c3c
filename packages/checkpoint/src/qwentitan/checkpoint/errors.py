"""The one exception a user of qwentitan.checkpoint can cause."""


class CheckpointError(Exception):
    """A problem with the user's input: one sentence naming what is wrong, where, and the fix.

    The CLI prints it without a traceback and exits with code 2.
    """
