"""The training loop: Trainer, per-micro-batch step, optimizer and schedule, metrics, loggers."""
