"""tools/sass_loops.py: the nvdisasm parsing on a made-up listing, and a real build against git HEAD (CPU only)."""
import subprocess
from pathlib import Path

import pytest

from tools import sass_loops

LISTING = """
	.section	.text.kern,"ax",@progbits
.text.kern:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
.L_x_0:
        /*0020*/                   PRMT R8, R4, 0x1010, RZ ;
        /*0030*/                   HFMA2.BF16_V2 R9, R8, R5.H0_H0, R6 ;
        /*0040*/              @!P0 BRA `(.L_x_0) ;
        /*0050*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0060*/               @P1 BRA `(.L_x_1) ;
        /*0070*/                   STL [R1], R9 ;
        /*0080*/                   EXIT ;
	.section	.text.other,"ax",@progbits
.text.other:
        /*0000*/                   EXIT ;
"""


def test_parse_a_listing():
    assert sass_loops.opcode("@!P0 HFMA2.BF16_V2 R9, R8, R5.H0_H0, R6") == "HFMA2"
    bodies = sass_loops.function_bodies(LISTING)
    assert set(bodies) == {"kern", "other"}
    instructions, labels = bodies["kern"]
    assert len(instructions) == 9 and labels == {".L_x_1": 1, ".L_x_0": 2}
    assert len(sass_loops.largest_math_loop(instructions, labels)) == 6   # .L_x_1 .. its branch
    stats = sass_loops.entry_stats(LISTING, {"kern<1>": "kern", "gone<2>": "missing"}, {"kern<1>": 40})
    s = stats["kern<1>"]
    assert set(stats) == {"kern<1>"} and (s.registers, s.instructions, s.loop, s.prmt, s.spills) == (40, 9, 6, 1, 1)
    assert s.loop_ops["HFMA2"] == 1 and s.loop_ops["BRA"] == 2
    # another build of the same code numbers its labels and helpers otherwise: the canonical text is the same
    renumbered = LISTING.replace(".L_x_1", ".L_x_7").replace(".L_x_0", ".L_x_6")
    assert sass_loops.entry_stats(renumbered, {"k": "kern"}, {})["k"].text == s.text
    assert sass_loops.canonical(["CALL.REL.NOINC `($__internal_4_$__cuda_sm20_rcp_rn_f32_slowpath) ;"]) == \
        sass_loops.canonical(["CALL.REL.NOINC `($__internal_2_$__cuda_sm20_rcp_rn_f32_slowpath) ;"])
    changed = LISTING.replace("0x1010", "0x3232")
    assert sass_loops.entry_stats(changed, {"k": "kern"}, {})["k"].text != s.text


def test_build_against_head(capsys):
    from runtime.cuda import nvrtc
    if nvrtc.find_disassembler() is None:
        pytest.skip("no nvdisasm: the SASS is not readable here")
    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no revision to build against")
    assert sass_loops.main(["norm_rope", "--entry", "rmsnorm_kernel", "--base", "HEAD"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "rmsnorm_kernel" and out[2].split()[0] == "HEAD" and out[3].split()[0] == "now"
    assert "regs" in out[2] and "loop" in out[3]
    assert out[4].split() == ["SASS", "the", "same"] or out[4].split() == ["SASS", "differs"]


def test_registered_entries_of_another_checkout(tmp_path):
    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no revision to read")
    entries = sass_loops.registered_entries(sass_loops.kernels_at("HEAD", tmp_path), "norm_rope")
    assert "rmsnorm_kernel" in entries
    assert sass_loops.registered_entries(tmp_path / "cutlass_kernels", "no_such_family") == set()
