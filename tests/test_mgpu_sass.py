"""mgpu_sass.py's loop finder on a made-up SASS listing: the innermost backward branch
whose body holds the HGMMAs, its opcodes without predicates or modifiers."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import mgpu_sass  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   UTMALDG.4D [UR8], [UR4] ;
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R6+URZ], R11 ;
        /*0030*/              @!P0 BRA 0x20 ;
        /*0040*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0050*/                   PRMT R9, R8, 0x5140, R10 ;
        /*0060*/                   HFMA2.BF16_V2 R9, R9, R12, R13 ;
        /*0070*/                   WARPGROUP.ARRIVE ;
        /*0080*/                   HGMMA.64x16x16.F32.BF16 R24, R8, gdesc[UR16], R24, gsb0 ;
        /*0090*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00a0*/               @P0 BRA 0x40 ;
        /*00b0*/                   @UP0 UTMALDG.4D [UR8], [UR4] ;
        /*00c0*/                   BRA 0x10 ;
        /*00d0*/                   EXIT ;
"""


def test_main_loop_is_the_innermost_branch_around_the_wgmma():
    # 0x40..0xa0 (7 instructions), not the outer 0x10..0xc0 nor the wait loop at 0x20
    assert mgpu_sass.main_loop(SASS) == ["LDSM", "PRMT", "HFMA2", "WARPGROUP", "HGMMA",
                                         "WARPGROUP", "BRA"]


def test_no_loop_is_an_empty_list():
    assert mgpu_sass.main_loop("        /*0000*/                   EXIT ;\n") == []
