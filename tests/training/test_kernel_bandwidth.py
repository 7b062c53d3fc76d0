"""benchmarks/kernel_bandwidth.py: inductor's Triton kernels read from their source, and the
time each loses against a device copy.

On the GPU machine the sources come from inductor; here a wrapper in inductor's format stands
in for them (the `inductor_meta` repr that inductor's own `metrics._parse_kernel_args_num_gb`
reads the estimate from). The arithmetic is the profile's: what it says on the GPU is what
it says here.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch._inductor.codecache import PyCodeCache

from bertforge.training.compile_cache import use_cache_per_cpu_level
from tests.support.benchmark_scripts import benchmark_module


@pytest.fixture(scope="module")
def kb():
    with benchmark_module("kernel_bandwidth") as module:
        yield module


def triton_kernel(name: str, body: str, num_gb: float | None) -> str:
    """One kernel as inductor's wrapper embeds it (abridged: the parts the parser reads), its
    metadata written as inductor writes it (the dicts' repr), then the harness that
    `benchmark_kernel` adds, whose example inputs are random but draw nothing in the kernel."""
    triton_meta = {"signature": {"in_ptr0": "*bf16", "out_ptr0": "*bf16"},
                   "configs": [{(0,): [["tt.divisibility", 16]]}]}
    inductor_meta = {"grid_type": "Grid1D", "autotune_hints": set(), "kernel_name": name,
                     "mutated_arg_names": [], "tiling_scores": {"x": 1, "r0_": 2}}
    if num_gb is not None:
        inductor_meta["kernel_num_gb"] = num_gb
    return f"""
{name} = async_compile.triton({name!r}, '''
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers, triton_heuristics

@triton_heuristics.persistent_reduction(
    size_hints={{'x': 32768, 'r0_': 1024}},
    filename=__file__,
    triton_meta={triton_meta!r},
    inductor_meta={inductor_meta!r}
)
@triton.jit
def {name}(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
{body}

def get_args():
    arg_0 = rand_strided((32768, 1024), (1024, 1), device='cuda:0', dtype=torch.bfloat16)
    return arg_0,


def call(args):
    with torch.cuda._DeviceGuard(0):
        stream0 = get_raw_stream(0)
        {name}.run(*args, stream=stream0)
''', device_str='cuda')
"""


DROPOUT_LN = triton_kernel(
    "triton_per_fused_add_native_dropout_native_layer_norm_0",
    "    tmp0 = tl.load(in_ptr0 + x0)\n    tmp1 = tl.rand(tmp0, (x0).to(tl.uint32))\n", 0.25)
GELU = triton_kernel("triton_poi_fused_gelu_1",
                     "    tmp0 = tl.load(in_ptr0 + x0)\n    tmp1 = libdevice.erf(tmp0)\n", 0.5)
NO_ESTIMATE = triton_kernel("triton_poi_fused_add_2", "    tmp0 = tl.load(in_ptr0 + x0)\n", None)
WRAPPER = "from torch._inductor.async_compile import AsyncCompile\n" + DROPOUT_LN + GELU + \
    NO_ESTIMATE + "\ndef call(args):\n    pass\n"


def test_each_kernel_of_a_wrapper_has_its_own_size_and_random_draws(kb):
    kernels = kb.parse_kernels(WRAPPER)
    assert kernels == {
        "triton_per_fused_add_native_dropout_native_layer_norm_0": {"gb": 0.25, "random": True},
        "triton_poi_fused_gelu_1": {"gb": 0.5, "random": False},
        # Compiled without the estimate: no size, never another kernel's.
        "triton_poi_fused_add_2": {"gb": None, "random": False},
    }
    # A kernel's own module (the source alone, no wrapper around it) reads the same, also where
    # its def is plain `triton_` (some inductor versions): the metadata names it.
    alone = GELU.split("'''")[1]
    assert kb.parse_kernels(alone) == {"triton_poi_fused_gelu_1": {"gb": 0.5, "random": False}}
    plain = alone.replace("def triton_poi_fused_gelu_1(", "def triton_(")
    assert kb.parse_kernels(plain) == {"triton_poi_fused_gelu_1": {"gb": 0.5, "random": False}}
    # Neither names it (a template before its name is filled in): nothing to put a time against.
    unnamed = plain.replace("'kernel_name': 'triton_poi_fused_gelu_1'",
                            "'kernel_name': 'Placeholder.DESCRIPTIVE_NAME'")
    assert kb.parse_kernels(unnamed) == {}


def test_a_name_two_different_kernels_share_has_no_size(kb, tmp_path, monkeypatch):
    """Two graphs (a layer's forward and backward) can each name a kernel `..._0`; a profile
    sums both under that name, so no one size may be put against its time."""
    other = triton_kernel("triton_poi_fused_gelu_1", "    pass\n", 0.125)
    modules = []
    for i, source in enumerate((WRAPPER, other, GELU)):
        path = tmp_path / f"wrapper{i}.py"
        path.write_text(source)
        modules.append(types.SimpleNamespace(__file__=str(path)))
    modules.append(types.SimpleNamespace(__file__=str(tmp_path / "gone.py")))  # removed since
    cpp = tmp_path / "cpp_wrapper.py"
    cpp.write_text("cpp_fused_gelu_0 = async_compile.cpp_pybinding(['float*'], r'''...''')\n")
    modules.append(types.SimpleNamespace(__file__=str(cpp)))
    monkeypatch.setattr(PyCodeCache, "modules", modules)
    kernels = kb.loaded_kernels()
    assert kernels["triton_poi_fused_gelu_1"]["gb"] is None
    assert kernels["triton_per_fused_add_native_dropout_native_layer_norm_0"]["gb"] == 0.25
    # What gpu_check.sh brings back from the GPU: the modules with a Triton kernel, as written.
    assert kb.save_sources(str(tmp_path / "sources")) == 3
    assert (tmp_path / "sources" / "wrapper0.py").read_text() == WRAPPER


def test_kernels_written_to_the_cache_since_the_estimates_are_found_too(kb, tmp_path,
                                                                       monkeypatch):
    """Where inductor's bookkeeping of loaded modules does not list a kernel (it has changed
    between versions), what it wrote to its cache folder after `enable_estimates` still counts;
    what it wrote before (another process's kernels, no estimates) does not."""
    # inductor's own patch, not monkeypatch's: pytest 9.2 undoes a setattr on a module by
    # deleting the name, and a deleted inductor setting stays hidden (every later compile in
    # the process fails on it).
    with torch._inductor.config.patch(benchmark_kernel=False):
        monkeypatch.setattr(kb, "_estimates_since", None)
        monkeypatch.setattr(PyCodeCache, "modules", [])
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        (tmp_path / "ab").mkdir()
        earlier = tmp_path / "ab" / "earlier.py"
        earlier.write_text(triton_kernel("triton_poi_fused_mul_3", "    pass\n", 0.0625))
        os.utime(earlier, (0, 0))
        kb.enable_estimates()
        assert kb.estimates_enabled()
        (tmp_path / "ab" / "wrapper.py").write_text(WRAPPER)
        assert sorted(kb.loaded_kernels()) == sorted(kb.parse_kernels(WRAPPER))


def test_time_lost_against_the_copy_bandwidth(kb):
    known = kb.parse_kernels(WRAPPER)
    # Two profiled steps; per step: the dropout kernel twice at 100 us, GELU once at 250 us.
    kernels = {"triton_per_fused_add_native_dropout_native_layer_norm_0": (4, 400.0),
               "triton_poi_fused_gelu_1": (2, 500.0),
               "triton_poi_fused_add_2": (2, 60.0),
               "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": (2, 9000.0)}
    report = kb.bandwidth_report(kernels, known, copy_gbps=4000.0, steps=2)
    assert report["triton_ms_per_step"] == pytest.approx(0.2 + 0.25 + 0.03)  # no GEMM in it
    assert report["sized_ms_per_step"] == pytest.approx(0.45)
    assert report["sized_gb_per_step"] == pytest.approx(2 * 0.25 + 0.5)
    assert report["sized_floor_ms_per_step"] == pytest.approx(1e3 * 1.0 / 4000)
    assert report["random_ms_per_step"] == pytest.approx(0.2)
    gelu, dropout = report["top_lost"]  # most time lost first
    # 0.5 GB in 0.2 ms is 2,500 GB/s, 0.125 ms at the copy's 4,000: 0.075 ms lost.
    assert dropout["achieved_gbps"] == pytest.approx(2500)
    assert dropout["lost_ms_per_step"] == pytest.approx(0.075)
    assert dropout["random"] is True
    assert gelu["lost_ms_per_step"] == pytest.approx(0.25 - 0.125)
    # Every kernel in the JSON, those without a size too, longest first.
    assert [r["name"] for r in report["kernels"]] == [
        "triton_poi_fused_gelu_1", "triton_per_fused_add_native_dropout_native_layer_norm_0",
        "triton_poi_fused_add_2"]
    assert report["kernels"][2]["lost_ms_per_step"] is None
    lines = "\n".join(kb.markdown(report))
    assert "they move 1.0 GB/step" in lines and "copy runs at 4,000 GB/s" in lines
    assert "(achieved 2,222 GB/s)" in lines  # 1.0 GB in 0.45 ms
    assert lines.index("gelu_1") < lines.index("dropout")  # most time lost first


def test_no_triton_kernel_no_section(kb):
    """A CPU run: inductor writes C++, no kernel has a size and the section says nothing."""
    use_cache_per_cpu_level()  # as build_engine: kernels cached for another vector level crash
    compiled = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2)
    compiled(torch.randn(64))
    report = kb.bandwidth_report({"cpp_fused_gelu_mul_0": (1, 5.0)}, kb.loaded_kernels(),
                                 copy_gbps=kb.copy_bandwidth_gbps("cpu"), steps=1)
    assert report["copy_gbps"] is None and report["triton_ms_per_step"] == 0
    assert kb.markdown(report) == []
