"""benchmarks/kernel_model.py: the SASS reading (on a captured snippet, and on a kernel nvcc compiles
here when nvcc and cuobjdump are present), the exact interpolation behind the scaling rule, the
micro model's size map, and one hot op's fit checked at a shape outside its grid."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_model as km  # noqa: E402

# cuobjdump -sass output in its own format (the encodings' second lines and the header kept). The
# loop is 0x0090..0x0140: the back edge `@P0 BRA 0x90`. By hand, its fast path (forward branches
# inside the loop taken, the call not entered) is 0x90 LDS, 0xa0 LDS, 0xb0 FMUL, 0xc0 LOP3, 0xd0 BRA
# (to 0xf0), 0xf0 FADD, 0x100 FFMA, 0x110 FFMA, 0x120 IADD3, 0x130 ISETP, 0x140 BRA: 11 issued of 12
# static; multiply-adds = 2 FFMA + min(1 FMUL, 1 FADD) = 3; 11 / 3 instructions per multiply-add; the
# loop at 0x170..0x180 has no arithmetic; IMMA.16832 is 16*8*32/32 = 128 multiply-adds per thread.
SNIPPET = """
	code for sm_90
		Function : o1b_toy
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                     /* 0x00000a00ff017b82 */
                                                                                              /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                                         /* 0x0000000000007919 */
                                                                                              /* 0x000e220000002100 */
        /*0020*/                   MOV R7, RZ ;                                               /* 0x000000ff00077202 */
        /*0030*/                   MOV R8, RZ ;
        /*0040*/                   MOV R9, RZ ;
        /*0050*/                   MOV R10, RZ ;
        /*0060*/                   MOV R11, RZ ;
        /*0070*/                   MOV R12, RZ ;
        /*0080*/                   MOV R13, RZ ;
        /*0090*/                   LDS R4, [R2] ;                                             /* 0x0000000002047984 */
        /*00a0*/                   LDS R5, [R3] ;
        /*00b0*/                   FMUL.FTZ R6, R4, R5 ;                                      /* 0x0000000504067220 */
        /*00c0*/                   LOP3.LUT P2, RZ, R6, 0x7f800000, RZ, 0xc0, !PT ;
        /*00d0*/               @P2 BRA 0xf0 ;                                                 /* 0x00000000002c2947 */
        /*00e0*/                   CALL.REL.NOINC 0x200 ;
        /*00f0*/                   FADD.FTZ R7, R7, R6 ;
        /*0100*/                   FFMA R8, R4, R5, R8 ;
        /*0110*/                   FFMA R9, R4, R4, R9 ;
        /*0120*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0130*/                   ISETP.NE.AND P0, PT, R2, R10, PT ;
        /*0140*/               @P0 BRA 0x90 ;                                                 /* 0xfffffffc00d00947 */
        /*0150*/                   IMMA.16832.S8.S8 R20, R12, R16, R20 ;
        /*0160*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0170*/                   IADD3 R11, R11, 0x1, RZ ;
        /*0180*/              @!P1 BRA 0x170 ;
        /*0190*/                   EXIT ;
		..........
"""


def test_sass_parser_on_a_captured_snippet():
    (name, instrs), = km.parse_sass(SNIPPET).items()
    assert name == "o1b_toy" and len(instrs) == 26
    assert instrs[13].op == "@P2 BRA".split()[1] and instrs[13].pred == "@P2" and instrs[13].target() == 0xF0
    spans = km.loops(instrs)
    assert [(instrs[h].addr, instrs[t].addr) for h, t in spans] == [(0x90, 0x140), (0x170, 0x180)]
    s = km.loop_stats(instrs, *spans[0])
    assert (s.static, s.issued, s.ffma, s.fmul, s.fadd, s.madds, s.calls, s.loads) == (12, 11, 2, 1, 1, 3, 0, 2)
    assert s.per_madd == 11 / 3 and s.kind == "fused"
    assert [x.head for x in km.hot_loops(instrs)] == [0x90]          # the other loop does no arithmetic
    assert km._mma_macs("IMMA.16832.S8.S8") == 128 and km._mma_macs("HMMA.16816.F32.BF16") == 64
    assert km._mma_macs("HGMMA.64x128x16.F32.BF16") == 1024 and km._mma_macs("FFMA") == 0


def test_resource_lines():
    text = """ptxas info    : Compiling entry function 'o1b_toy' for 'sm_90'
ptxas info    : Function properties for o1b_toy
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 194 registers, used 1 barriers, 16432 bytes smem, 432 bytes cmem[0]
ptxas info    : Function properties for o1b_other
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 26 registers, used 0 barriers, 400 bytes cmem[0]
"""
    r = km.parse_resources(text)
    assert r["o1b_toy"] == {"registers": 194, "stack": 8, "spill_stores": 4, "spill_loads": 12, "smem": 16432}
    assert r["o1b_other"]["registers"] == 26 and r["o1b_other"]["smem"] == 0


def test_interpolation_is_exact_for_polynomials_of_the_grid_degree():
    def f(x, y):                                  # degree 1 in x, 2 in y
        return 3 * x * y * y + 2 * x + 5 * y + 1
    grid = {"x": [1, 2], "y": [3, 5, 9]}
    values = {(x, y): f(x, y) for x in grid["x"] for y in grid["y"]}
    for at in ({"x": 7, "y": 11}, {"x": 4096, "y": 128256}, {"x": 0, "y": 0}):
        assert km.interpolate(grid, values, at) == f(at["x"], at["y"])
    values[(2, 9)] += 1                           # a count that is not such a polynomial is caught
    assert km.interpolate(grid, values, {"x": 7, "y": 11}) != f(7, 11)


def test_check_counts_structure_exact_data_within_tolerance():
    m = {"k": dict.fromkeys(km.QUANTITIES, 100)}
    p = {"k": {q: float(v) for q, v in m["k"].items()}}
    assert km.check_counts(m, p) == ([], 0.0)
    p["k"]["add"] = 104.0                         # data-dependent: within 5%
    assert km.check_counts(m, p)[0] == []
    p["k"]["read"] = 101.0                        # structural: must be exact
    assert km.check_counts(m, p)[0] == ["k.read: measured 100, predicted 101"]


def test_micro_sizes_name_one_dimension_each():
    from mlx_open1b.config import ModelConfig, preset
    big = preset("open1b")
    micro = km.size_table(ModelConfig(**km.MICRO), km.MICRO_SEQS)
    sizes = km.size_table(big.model, big.train.microbatch_seqs)
    m = km.size_map(micro, sizes)
    assert m[micro["d"]] == 2048 and m[micro["QKV"]] == (16 + 8) * 128 and m[micro["N"]] == 4 * 4096
    # a flat size rows x width maps to the open1b rows x width
    assert km.map_dims({"n": micro["NH"] * micro["D"]}, m, micro, sizes) == {"n": 4 * 4096 * 16 * 128}
    with pytest.raises(ValueError, match="both"):
        km.size_map(dict(micro, F=micro["d"]), sizes)


def test_a_fit_predicts_a_shape_outside_its_grid():
    """rmsnorm_forward on the CUDA emulator: the interpolation from its grid predicts the counts of
    the check shape exactly (what `fit` reports as the scaling rule's check)."""
    from mlx_open1b import backend
    f = km.fit(backend.load("cuda"), km.workloads()["rmsnorm_forward"][0], log=lambda *_: None)
    assert f.check_ok, f.check_diff
    (k, got), = f.check_measured.items()
    assert got["read"] > 0 and got["launches"] == 1


@pytest.mark.skipif(shutil.which("nvcc") is None or km.find_tool("cuobjdump", None) is None,
                    reason="needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_nvcc_sass_of_a_fused_loop(tmp_path):
    """A kernel whose only loop is a chain of __fmaf_rn: its hot loop is fused, every FFMA one
    multiply-add, and the loop issues at least one instruction per FFMA."""
    cu = tmp_path / "toy.cu"
    cu.write_text('extern "C" __global__ void toy(const float *a, const float *b, float *y, int n) {\n'
                  '    float acc = 0.0f;\n'
                  '    for (int j = 0; j < n; j++) acc = __fmaf_rn(a[j], b[j], acc);\n'
                  '    y[threadIdx.x] = acc;\n}\n')
    r = km.sass_report(tmp_path, None)
    s = r["toy.cu"]["toy"]["loops"][0]
    assert s.kind == "fused" and s.ffma >= 1 and s.madds == s.ffma and s.issued >= s.ffma
    assert r["toy.cu"]["toy"]["registers"] > 0
