"""The one exception type a user of qwentitan-launch can cause."""


class LaunchError(Exception):
    """A mistake the user can fix; the message is one sentence that names the fix."""
