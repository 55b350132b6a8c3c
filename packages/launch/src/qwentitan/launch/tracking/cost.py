"""Cost per million tokens, so runs on different hardware compare by money as well as speed.

The prices are the Targets' (`target.py`): a small, dated list of on-demand Linux prices (USD
per instance-hour, us-east-1). Prices change: the date says how old a figure is, and
`MLflowLogger.Config.price_per_hour` (`--metrics.mlflow.price_per_hour`, default
`$QWENTITAN_PRICE_PER_HOUR`) overrides it.
An instance with no price gets no cost metric rather than a made-up one.
"""

from __future__ import annotations

from qwentitan.launch.base.target import PRICE_AS_OF, PRICE_SOURCE, TARGETS


def hourly_price(instance_type: str, configured: float | None = None) -> tuple[float, str] | None:
    """(USD per instance-hour, where the figure came from), or None when nothing is known."""
    if configured is not None:
        return configured, "config"  # MLflowLogger.Config checked it is positive
    target = TARGETS.get(instance_type)
    if target is None or target.price_per_hour is None:
        return None
    return target.price_per_hour, f"catalogue {PRICE_AS_OF} ({PRICE_SOURCE})"


def cost_per_million_tokens(
    usd_per_hour: float, tokens_per_second: float, instances: int = 1
) -> float | None:
    """USD per 10^6 tokens at a whole-job throughput, paying for `instances` hosts."""
    if tokens_per_second <= 0:
        return None
    return usd_per_hour * instances / (tokens_per_second * 3600.0) * 1e6
