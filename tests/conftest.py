"""Test setup: 8 fake CPU devices for mesh tests, set before JAX is imported anywhere (pytest_configure runs
before test modules are collected).

The default run is CPU-only (JAX_PLATFORMS=cpu), so results do not depend on an accelerator being present.
Selecting the accelerator tests (`pytest -m gpu` / `-m tpu`) leaves the platform to JAX, so they run compiled.
"""
import os
import pathlib
import re

import pytest

SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def pytest_configure(config):
    markexpr = config.getoption("markexpr", "") or ""
    wants_accelerator = re.search(r"(?<!not )\b(gpu|tpu)\b", markexpr) is not None
    if not wants_accelerator:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


@pytest.fixture
def shared_data():
    """Path to ../shared/data; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def _tiny_model(name: str):
    from pdjax.config.model_specs import get_model_spec
    from pdjax.models.llama import init_params
    spec = get_model_spec(name)
    return spec, init_params(spec, seed=0)


@pytest.fixture(scope="session")
def tiny_llama():
    """(spec, params) of tiny-llama, seed 0: the engine tests' model, made once per session."""
    return _tiny_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_mha():
    """(spec, params) of tiny-mha, seed 0, made once per session."""
    return _tiny_model("tiny-mha")
