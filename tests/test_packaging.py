"""What a packager and a first-time user meet: the version, the license, the metadata, the
README as the package index shows it, and the extras' messages."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import aiokvo
from aiokvo.telemetry import cli

ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_prints_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"aiokvo {aiokvo.__version__}"


def test_the_version_is_the_installed_distributions() -> None:
    import importlib.metadata

    assert importlib.metadata.version("aiokvo") == aiokvo.__version__


def _project() -> dict[str, object]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert isinstance(project, dict)
    return project


def test_the_declared_license_ships_in_full() -> None:
    project = _project()
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert "9. Accepting Warranty or Additional Liability." in text  # the last section


def test_the_metadata_names_the_project_urls() -> None:
    urls = _project()["urls"]
    assert isinstance(urls, dict)
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    assert all(str(url).startswith("https://") for url in urls.values())


_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _slugs(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings."""
    slugs = set()
    for title in re.findall(r"^#+ (.+)$", _FENCE.sub("", markdown), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_the_readme_links_work_on_the_package_index() -> None:
    """The README is the long description: its links are absolute (into the repository
    at the Source URL, to a file and heading that exist) or point into the README."""
    source = _project()["urls"]["Source"]  # type: ignore[index]
    readme = (ROOT / "README.md").read_text()
    links = _LINK.findall(_FENCE.sub("", readme))
    assert links
    for link in links:
        if link.startswith("#"):
            assert link[1:] in _slugs(readme), link
            continue
        assert link.startswith("https://"), f"relative link {link!r} breaks on the index"
        if not link.startswith(f"{source}/"):
            continue
        path, _, anchor = link.removeprefix(f"{source}/").partition("#")
        kind, branch, rel = path.split("/", 2)
        assert (kind, branch) == ("blob", "main") or (kind, branch) == ("tree", "main"), link
        target = ROOT / rel
        assert target.exists(), link
        if anchor:
            assert anchor in _slugs(target.read_text()), link


def test_install_first_says_how_cpu_users_get_the_cpu_torch_wheel() -> None:
    readme = (ROOT / "README.md").read_text()
    sections = re.split(r"^## ", readme, flags=re.M)
    install = next(s for s in sections if s.startswith("Install\n"))
    first_block = install.split("```sh\n", 1)[1].split("```", 1)[0]
    first = first_block.splitlines()[0]
    assert first.startswith("pip install ") and "torch" in first
    assert "--index-url https://download.pytorch.org/whl/cpu" in first
    assert sections.index(install) < min(
        i for i, s in enumerate(sections) if s.startswith(("Set up", "Quick start"))
    )


def test_the_declared_torch_range_is_the_tested_one() -> None:
    """The range admits the torch the Makefile pins (the suite's) and no later minor
    release, and the README's CPU install line asks for exactly that range."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    dependencies = _project()["dependencies"]
    assert isinstance(dependencies, list)
    declared = next(Requirement(r) for r in dependencies if r.startswith("torch")).specifier
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text())
    assert pinned is not None
    major, minor = (int(x) for x in pinned.group(1).split(".")[:2])
    assert declared.contains(pinned.group(1))
    assert not declared.contains(f"{major}.{minor + 1}.0")
    readme = re.search(r"pip install 'torch([^']+)' --index-url", (ROOT / "README.md").read_text())
    assert readme is not None
    assert SpecifierSet(readme.group(1)) == declared


@pytest.mark.system
@pytest.mark.parametrize(("statement", "extra"), [
    ("from aiokvo.tiers import DiskTier", "disk"),
    ("import aiokvo.tiers.disk.store", "disk"),
    ("import aiokvo.tiers.mooncake.format", "mooncake"),
])  # fmt: skip
def test_an_extra_that_is_missing_is_named(statement: str, extra: str) -> None:
    """Importing a tier without xxhash, by its public name or its module, names the
    extra that installs it."""
    code = (
        "import sys; sys.modules['xxhash'] = None\n"
        "try:\n"
        f"    {statement}\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc.name, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ModuleNotFoundError xxhash "), out.stdout
    assert f"pip install 'aiokvo[{extra}]'" in out.stdout
