"""Experiment layer (above serving and sim): run one config on either backend, and sweeps of configs."""
