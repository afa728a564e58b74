"""Thin absl entry points (python -m experiments.<name>)."""
