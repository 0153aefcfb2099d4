"""bench/matmuls.py: `--against` times the Q4_1 panels by another source of the
kernel over the same bytes, and refuses a source that lays panels out otherwise."""

import pytest

from bench.matmuls import KINDS, run
from engines import panels

needs_formats = pytest.mark.skipif(panels.kernel() is None or not panels.kernel().formats,
                                   reason="no panels kernel with block formats on this machine")


@needs_formats
def test_another_source_of_the_kernel_is_timed_beside_the_engine_s():
    res = run((1, 4), layers=1, rounds=1, threads=1, against=panels.SOURCE)
    assert set(res) == {1, 4}
    for best in res.values():
        assert list(best) == list(KINDS)  # every kernel, the other source's last
        assert all(0 < s < 10 for s in best.values())


@needs_formats
def test_a_source_with_another_panel_layout_is_refused(tmp_path):
    src = tmp_path / "panels.c"
    src.write_text(panels.SOURCE.read_text().replace("#define R 4 ", "#define R 8 ", 1))
    with pytest.raises(SystemExit, match="not the same panels layout"):
        run((1,), layers=1, rounds=1, threads=1, against=src)
