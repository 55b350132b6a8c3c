"""MLflow tracking overhead as a share of a training step, on the tiny dense Qwen3 (CPU).

Three modes, interleaved round by round so machine load hits them alike: no tracking; tracking
into a local sqlite store (spool + background writer); tracking against an unreachable server.
Prints each mode's median step time as a ratio to the untracked one, and the time `log()`
itself takes on the training thread as a share of the step. Goal: at most 1%.
"""

from __future__ import annotations

import logging
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qwentitan.launch.tracking import MLflowLogger
from qwentitan.modeling import get_flavor, model_spec

ROUNDS, STEPS, BATCH, SEQ = 3, 6, 1, 64

# What torchtitan's MetricsProcessor hands a logger each step (names and count as in 0.3.0).
METRIC_KEYS = [
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "throughput(tps)",
    "tflops",
    "time_metrics/end_to_end(s)",
    "time_metrics/data_loading(s)",
    "time_metrics/data_loading(%)",
    "memory/max_active(GiB)",
    "memory/max_active(%)",
    "memory/max_reserved(GiB)",
    "memory/max_reserved(%)",
    "memory/num_alloc_retries",
    "memory/num_ooms",
    "n_tokens_seen",
    "lr",
    "memory/rss_gib",
]


def closed_port_uri() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def main() -> None:
    logging.disable(logging.WARNING)  # the unreachable mode warns by design
    torch.manual_seed(0)
    model = model_spec("tiny-dense").model.build()
    model.init_states()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = get_flavor("tiny-dense").vocab_size
    tokens = torch.randint(vocab, (BATCH, SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def train_step() -> float:
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    for _ in range(2):
        train_step()  # allocator and kernel warm-up, outside every measurement

    work = Path(tempfile.mkdtemp(prefix="bench_tracking_"))
    uris = {"sqlite": f"sqlite:///{work / 'mlflow.db'}", "unreachable": closed_port_uri()}
    step_times: dict[str, list[float]] = {"off": [], "sqlite": [], "unreachable": []}
    log_times: list[float] = []
    global_step = 0
    for round_ in range(ROUNDS):
        for mode in step_times:
            logger = None
            if mode != "off":
                logger = MLflowLogger.Config(
                    tracking_uri=uris[mode], recipe="bench_tracking", close_timeout_s=60
                ).build(run_dir=work / f"{mode}-{round_}", config_dict={"bench": True})
            for _ in range(STEPS):
                global_step += 1
                start = time.perf_counter()
                loss = train_step()
                if logger is not None:
                    before = time.perf_counter()
                    logger.log({key: loss for key in METRIC_KEYS}, global_step)
                    log_times.append(time.perf_counter() - before)
                step_times[mode].append(time.perf_counter() - start)
            if logger is not None:
                logger.close()

    base = statistics.median(step_times["off"])
    print(
        f"bench_tracking: tiny-dense, batch {BATCH}x{SEQ}, {ROUNDS} rounds x {STEPS} steps per mode"
    )
    print(f"  untracked median step          {base * 1e3:9.2f} ms  (ratio 1.000)")
    for mode in ("sqlite", "unreachable"):
        median = statistics.median(step_times[mode])
        print(
            f"  tracked ({mode:<11}) median  {median * 1e3:9.2f} ms  (ratio {median / base:.3f}, "
            f"overhead {100 * (median / base - 1):+.2f}%)"
        )
    log_cost = statistics.median(log_times)
    print(
        f"  MLflowLogger.log() on the training thread: median {log_cost * 1e6:.0f} us = "
        f"{100 * log_cost / base:.3f}% of a step (goal <= 1%)"
    )


if __name__ == "__main__":
    main()
