"""What tunepilot keeps between processes of its own derivations (tunepilot/derived.py): the
time model's fit read back is the fit computed, a damaged or foreign entry is recomputed, an
unwritable cache costs only the time, and an edit to any package file is a new key."""

from __future__ import annotations

import json
import os

from tunepilot import derived
from tunepilot.cost import calibration


def test_the_fit_read_back_is_the_fit_computed(tmp_path, monkeypatch):
    monkeypatch.setenv(derived.CACHE_ENV, str(tmp_path))
    calibration.fitted.cache_clear()
    first = calibration.fitted()  # computed and stored
    (entry,) = (tmp_path / "derived").iterdir()
    calibration.fitted.cache_clear()
    again = calibration.fitted()  # read back
    assert again.cells == first.cells == calibration.fit_cells().cells
    assert list(again.cells) == list(first.cells)  # the order routes break ties by
    entry.write_text("[[1, 2]]")  # damaged
    calibration.fitted.cache_clear()
    assert calibration.fitted().cells == first.cells
    assert json.loads(entry.read_text())[0][0] == list(next(iter(first.cells)))
    calibration.fitted.cache_clear()


def test_an_unwritable_cache_only_costs_the_time(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(derived.CACHE_ENV, str(blocker))  # a file where a directory should be
    calls = []
    for _ in range(2):
        assert derived.cached("x", "k", lambda: calls.append(1) or 7, int, int) == 7
    assert calls == [1, 1]


def test_any_package_file_changed_is_a_new_key(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(derived, "PACKAGE", package)
    derived.package_stamp.cache_clear()
    before = derived.package_stamp()
    derived.package_stamp.cache_clear()
    assert derived.package_stamp() == before
    st = os.stat(package / "sub" / "a.py")
    os.utime(package / "sub" / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    derived.package_stamp.cache_clear()
    assert derived.package_stamp() != before
    derived.package_stamp.cache_clear()
