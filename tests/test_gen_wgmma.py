"""scripts/gen_wgmma.py still writes the committed csrc/primitives/wgmma_instructions.h byte for
byte: a hand edit of the header, or a generator change committed without its header, fails here.
Needs the source tree (csrc/, scripts/); the packaging run outside the tree skips it."""

from __future__ import annotations

import os

import pytest

from conftest import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATOR = os.path.join(ROOT, "scripts", "gen_wgmma.py")
COMMITTED_HEADER = os.path.join(ROOT, "csrc", "primitives", "wgmma_instructions.h")

pytestmark = pytest.mark.skipif(not (os.path.isfile(GENERATOR) and os.path.isfile(COMMITTED_HEADER)),
                                reason="needs the source tree (scripts/gen_wgmma.py, csrc/primitives/)")


def test_generator_reproduces_the_committed_header(tmp_path):
    gen_wgmma = load_script("gen_wgmma")
    assert os.path.samefile(gen_wgmma.HEADER, COMMITTED_HEADER)  # the file the script rewrites
    gen_wgmma.HEADER = str(tmp_path / "wgmma_instructions.h")  # written here; the committed one stays untouched
    gen_wgmma.main()
    with open(gen_wgmma.HEADER, "rb") as generated, open(COMMITTED_HEADER, "rb") as committed:
        assert generated.read() == committed.read(), (
            "csrc/primitives/wgmma_instructions.h is not what scripts/gen_wgmma.py writes: run "
            "`python scripts/gen_wgmma.py` and commit both")
