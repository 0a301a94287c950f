"""Embodied RL framework: config, cluster, channels, workers, algorithms, runner."""

__version__ = "0.1.0"
