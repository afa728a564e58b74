"""Every shipped sim config simulates to byte-identical requests.csv / iterations.csv / token_times.csv as the
records stored in tests/fixtures/sim (written by tests/make_sim_fixtures.py from the code before the simulator's
refactor and optimization). A case outside FAST_CASES runs with -m slow."""
import pytest

import make_sim_fixtures as fx


def _first_difference(expected: bytes, got: bytes) -> str:
    a, b = expected.decode().splitlines(), got.decode().splitlines()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i + 1}: expected {x!r}, got {y!r}"
    return f"{len(a)} lines expected, got {len(b)}"


def _params() -> list:
    return [pytest.param(name, marks=() if name in fx.FAST_CASES else (pytest.mark.slow,), id=name)
            for name in fx.CASES]


@pytest.mark.parametrize("name", _params())
def test_sim_outputs_match_fixtures(name, shared_data):
    digests = fx.read_digests()[name]
    files = fx.run_case(name)
    assert sorted(files) == sorted(digests)
    for file, data in files.items():
        if file in fx.stored_files(name):
            expected = fx.read_fixture(name, file)
            assert data == expected, f"{name}/{file}: {_first_difference(expected, data)}"
        assert fx.digest(data) == digests[file], f"{name}/{file}: SHA-256 differs from the fixture's"


def test_every_shipped_sim_config_has_a_case():
    used = {path for path, _, _ in fx.CASES.values()}
    shipped = {f"configs/sim/{p.name}" for p in (fx.REPO / "configs" / "sim").glob("*.py")}
    assert shipped - used == set(), "a configs/sim file without a fixture case"
    assert "configs/serve.py" in used
