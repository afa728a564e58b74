"""ruff.toml's rule that ruff cannot check itself: every suppressed lazy import (PLC0415) and broad except (BLE001)
outside tests says why, in parentheses after the code (ruff's RUF100 already fails a noqa that suppresses nothing)."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
NOQA = re.compile(r"#\s*noqa:\s*(PLC0415|BLE001)\b(.*)$")


def test_every_lazy_import_and_broad_except_noqa_says_why():
    bare = []
    for folder in ("pdjax", "experiments", "launch", "configs"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                m = NOQA.search(line)
                if m and not re.match(r"\s*\(\S.*\)", m.group(2)):
                    bare.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bare, "noqa without its reason (ruff.toml's header):\n" + "\n".join(bare)
