"""Experiment layer (above serving and sim): run one config on either backend, sweeps of configs, and the calibration
that probes the real engine and fits a simulator profile (calibrate)."""
