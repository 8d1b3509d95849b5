"""The installed distribution: everything under glm5_offload/, no generic top-level name, a glm5 script."""

import os
from importlib import metadata
from pathlib import Path

import pytest


def installed_files():
    # an installed distribution has a RECORD; a build's glm5_offload.egg-info beside the sources has none
    installed = [d for d in metadata.distributions(name="glm5-offload") if d.read_text("RECORD")]
    if not installed:
        pytest.skip("glm5-offload is not installed (running from a checkout)")
    return installed[0], [str(f) for f in installed[0].files]


def test_only_glm5_offload_lands_in_site_packages():
    dist, files = installed_files()
    top = {f.split("/")[0] for f in files if not f.startswith("..")}  # ../../bin/glm5 is the script
    assert top == {"glm5_offload", f"glm5_offload-{dist.version}.dist-info"}
    assert any(f == "glm5_offload/kernels/__init__.py" for f in files)
    assert any(f == "glm5_offload/cli.py" for f in files)


def test_every_subpackage_of_the_checkout_is_installed():
    _, files = installed_files()
    source = Path(__file__).parents[1] / "glm5_offload"
    packages = [Path(d).relative_to(source.parent) for d, _, names in os.walk(source, followlinks=True)
                if "__init__.py" in names]
    assert len(packages) > 5
    missing = [str(p) for p in packages if f"{p.as_posix()}/__init__.py" not in files]
    assert missing == []


def test_console_script_and_pinned_torch():
    dist, _ = installed_files()
    assert [e.value for e in dist.entry_points if e.name == "glm5"] == ["glm5_offload.cli:main"]
    requires = dist.requires or []
    assert "torch==2.13.0" in requires
    assert all("==" in r for r in requires if "extra ==" not in r)
