"""The one exception type a user of qwentitan-launch can cause."""

from __future__ import annotations

import re
from collections.abc import Callable

# A field named in a sentence: `{seq_len}`. Only these words are placeholders, so the paths and
# values a sentence quotes need no escaping.
_FIELD = re.compile(r"\{([a-z][a-z0-9_]*)\}")


class LaunchError(Exception):
    """A mistake the user can fix; the message is one sentence that names the fix.

    An error about a value of the run request carries that `field` (a `RunRequest` field name:
    `tp`, `ranks_per_node`, `run_dir`, ...) and names each field it mentions as `{field}`.
    `str()` fills them with the field names, as a Python caller writes them; the command line
    fills them with its own flags (`phrased`), so no library code spells a flag.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.template = message
        self.field = field
        # Placeholders exist only in a sentence about a field; any other is said as written.
        self.fields = tuple(dict.fromkeys(_FIELD.findall(message))) if field is not None else ()

    def phrased(self, word: Callable[[str], str]) -> str:
        """The sentence with each field named by `word(field)`."""
        if not self.fields:
            return self.template
        return _FIELD.sub(lambda m: word(m.group(1)), self.template)

    def __str__(self) -> str:
        return self.phrased(str)
