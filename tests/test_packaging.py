"""A non-editable install ships every package of dxrun/: pyproject.toml lists packages by name
(a package moved or added without its line imports from the checkout and fails from the wheel,
which only .ci/wheel_check would notice), and the files a package reads beside its modules."""

import tomllib
from conftest import ROOT


def test_every_package_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "dxrun").rglob("__init__.py")}
    assert on_disk <= listed, f"not in pyproject.toml's packages: {sorted(on_disk - listed)}"
    data = setuptools["package-data"]
    assert "dashboard.yaml" in data["dxrun.tracking"]
    assert (ROOT / "dxrun" / "tracking" / "dashboard.yaml").is_file()
