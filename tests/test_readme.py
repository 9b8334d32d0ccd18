"""CI must run the README's own two commands: a fresh clone gets from clone to green with them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", quick, re.S)]


def test_readme_has_exactly_two_commands_and_ci_runs_them():
    commands = readme_commands()
    assert len(commands) == 2
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for cmd in commands:
        assert cmd in ci_lines, f"{cmd!r} is not run by .ci/run"
