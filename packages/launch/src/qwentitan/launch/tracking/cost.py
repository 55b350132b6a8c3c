"""Cost per million tokens, so runs on different hardware compare by money as well as speed.

The catalogue is a small, dated list of on-demand Linux prices (USD per instance-hour,
us-east-1). Prices change: the date says how old a figure is, and
`MLflowLogger.Config.price_per_hour` (`--metrics.mlflow.price_per_hour`, default
`$QWENTITAN_PRICE_PER_HOUR`) overrides it.
An instance with no price gets no cost metric rather than a made-up one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstancePrice:
    instance_type: str
    usd_per_hour: float
    as_of: str
    source: str


# Public on-demand list prices as recorded on the date given; not re-verified since (no network
# in this project's CI). Check https://aws.amazon.com/ec2/pricing/on-demand/ before relying on them.
CATALOGUE: dict[str, InstancePrice] = {
    price.instance_type: price
    for price in (
        InstancePrice("trn1.32xlarge", 21.50, "2025-06-01", "AWS EC2 on-demand, us-east-1"),
        InstancePrice("trn2.48xlarge", 44.70, "2025-06-01", "AWS EC2 on-demand, us-east-1"),
        InstancePrice("p4d.24xlarge", 21.96, "2025-06-01", "AWS EC2 on-demand, us-east-1"),
        InstancePrice("p5.48xlarge", 55.04, "2025-06-01", "AWS EC2 on-demand, us-east-1"),
    )
}


def hourly_price(instance_type: str, configured: float | None = None) -> tuple[float, str] | None:
    """(USD per instance-hour, where the figure came from), or None when nothing is known."""
    if configured is not None:
        return configured, "config"  # MLflowLogger.Config checked it is positive
    entry = CATALOGUE.get(instance_type)
    if entry is None:
        return None
    return entry.usd_per_hour, f"catalogue {entry.as_of} ({entry.source})"


def cost_per_million_tokens(
    usd_per_hour: float, tokens_per_second: float, instances: int = 1
) -> float | None:
    """USD per 10^6 tokens at a whole-job throughput, paying for `instances` hosts."""
    if tokens_per_second <= 0:
        return None
    return usd_per_hour * instances / (tokens_per_second * 3600.0) * 1e6
