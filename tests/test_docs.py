"""The docs site builds: `make docs`'s Sphinx build, offline, with every warning an error."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _build(source: Path, out: Path) -> subprocess.CompletedProcess:
    # The command of `make docs` (Makefile), into a folder of the test's own.
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(source), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_the_docs_build_without_a_warning(tmp_path):
    conf = (DOCS / "conf.py").read_text()
    assert "sphinx.ext.intersphinx" not in conf, "the docs build offline: no extension may fetch an inventory"
    result = _build(DOCS, tmp_path / "html")
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
    assert "WARNING" not in result.stderr and "ERROR" not in result.stderr, result.stderr
    html = tmp_path / "html"
    # Every page of the tree is in the site: a page missing from every toctree is a warning, and
    # the pages the README links to are there.
    for page in (
        "index",
        "getting_started",
        "concepts/determinism",
        "guides/many_machines",
        "kernels",
        "measurements/index",
        "api/index",
        "api/replay",
    ):
        assert (html / f"{page}.html").is_file(), page
    assert "zeroth.replay.replay" in (html / "api" / "replay.html").read_text(), "autodoc rendered no API"


def test_a_warning_fails_the_build(tmp_path):
    # The same configuration on one page with a dangling link: -W turns it into a failed build.
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(DOCS / "conf.py", src / "conf.py")
    (src / "index.md").write_text("# A page\n\nSee [a page that is not there](nowhere.md).\n")
    result = _build(src, tmp_path / "html")
    assert result.returncode != 0, "a dangling link built without a warning: -W is not in force"
    assert "nowhere" in result.stderr, result.stderr


def test_citation_and_license_match_the_package():
    import tomllib

    import yaml

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["version"] == project["version"], "CITATION.cff names another version than pyproject.toml"
    assert cff["license"] == project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    for ref in cff.get("references", []):
        assert ref["title"] and ref["authors"] and ref["year"], ref
