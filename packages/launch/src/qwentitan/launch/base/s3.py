"""Deadlines for every S3 request of the launcher and the ranks, and one sentence for a failed one.

s3fs's own defaults retry a request that gets no answer 5 times, each through botocore's 5
attempts of 15 s: a paused server held a save for over 12 minutes with nothing printed. Here
botocore makes one attempt per s3fs retry, so a request that gets no answer fails in about
`DEADLINE_S` seconds, and the caller says so in one sentence (`failure`).
"""

from __future__ import annotations

from qwentitan.launch.base import env_defaults

__all__ = [
    "CLIENT_CONFIG",
    "DEADLINE_S",
    "apply_deadlines",
    "failure",
    "is_network_error",
    "no_answer",
]

_S3FS_RETRIES = 5  # s3fs's own (a class attribute, not an option): kept
CLIENT_CONFIG = {
    "connect_timeout": 10,
    "read_timeout": 20,
    "retries": {"max_attempts": 1, "mode": "standard"},  # s3fs retries; botocore does not too
}
DEADLINE_S = _S3FS_RETRIES * (CLIENT_CONFIG["read_timeout"] + 2)  # type: ignore[operator]

# botocore's (and aiohttp's) names for "the endpoint did not answer", by class name: neither
# needs importing here.
_NETWORK_ERRORS = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ServerDisconnectedError",
    "ClientConnectorError",
    "ClientOSError",
}


def apply_deadlines() -> None:
    """Make every S3 filesystem fsspec builds in this process (torch DCP's, torchtitan's, the
    launcher's) use `CLIENT_CONFIG`, unless the caller passed its own."""
    from fsspec.config import conf

    options = conf.setdefault("s3", {})
    options.setdefault("config_kwargs", CLIENT_CONFIG)


def is_network_error(error: BaseException) -> bool:
    """Whether `error` (or what caused it) says the endpoint did not answer."""
    seen: BaseException | None = error
    while seen is not None:
        if any(t.__name__ in _NETWORK_ERRORS for t in type(seen).__mro__):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def failure(url: str, error: BaseException) -> str | None:
    """One sentence for an S3 request on `url` that failed for want of credentials or an answer
    (None: another fault)."""
    names = {t.__name__ for t in type(error).__mro__}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return (
            f"No AWS credentials were found for {url}; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run on an instance with a role."
        )
    if is_network_error(error):
        return f"{no_answer(error)} for {url}; check the endpoint and the network, then try again."
    return None


# Failures to connect at all (refused, no route, no such host), as opposed to a timeout: said
# at once, not after DEADLINE_S. (botocore's ConnectTimeoutError subclasses the first.)
_UNREACHABLE = {"EndpointConnectionError", "ClientConnectorError"}


def no_answer(error: BaseException) -> str:
    """`S3 at ENDPOINT did not answer within N s (ErrorName)`, or `could not be reached` when
    the connection itself failed."""
    endpoint = env_defaults.s3_endpoint()
    where = f"S3 at {endpoint}" if endpoint else "S3"
    name = type(error).__name__
    if name in _UNREACHABLE:
        return f"{where} could not be reached ({name})"
    return f"{where} did not answer within {DEADLINE_S} s ({name})"
