"""The decode kernels' CUDA source run on the CPU (tests/cpu/simt_emu) through fwd_decode's own host
path — plan, split, launches, combine — against the float64 oracle: the GPU tests' bodies
(tests/gpu/test_decode.py) on CPU tensors, both ways K / V reach the registers (straight loads
and the cp.async pipeline, whose copies land only at their wait), as on a 132-SM GPU holding 3
CTAs per SM (the H200's split plans). Proves the kernels' index arithmetic, spans, pages, cache
rows, query rows, splits and NaN handling before a GPU runs them; it is not a GPU result (no
timing, no memory model but cp.async's groups). The emulator itself is tested at the end: a
pipeline that reads a stage one step early, a shuffle some lanes skip, a barrier.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from flashcuda.jit import KernelSpec
from flashcuda.ops import fwd_decode

from . import simt_emu

on_gpu = importlib.import_module("tests.gpu.test_decode")  # (its tests are not collected here)

pytestmark = pytest.mark.skipif(simt_emu.available() is not None,
                                reason=str(simt_emu.available()))


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    simt_emu.emulate(monkeypatch, fwd_decode, sms=132, resident=3)
    monkeypatch.setattr(on_gpu, "DEVICE", "cpu")


stages = on_gpu.stages  # (the GPU module's fixture: the lanes by registers / pipeline, the default)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (12, 2)], ids=["mha", "gqa4", "gqa6"])
@pytest.mark.parametrize("batch,keys", [(1, 1), (3, 77), (2, 1000)])
def test_decode_kernel_matches_the_oracle(dtype, head_dim, heads, batch, keys, stages):
    on_gpu.test_decode_kernel_matches_the_oracle(dtype, head_dim, heads, batch, keys, stages)


def test_many_splits_and_a_group_of_16(stages):
    """One entry's 20000 keys over many pieces (the combine), and GQA 16 (two row blocks)."""
    on_gpu.test_decode_kernel_matches_the_oracle(torch.bfloat16, 128, (32, 2), 1, 20000, stages)


@pytest.mark.parametrize("unroll,pipe", [(2, 2), (4, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("head_dim,heads", [(64, (8, 1)), (128, (32, 8)), (256, (16, 2))])
def test_pipeline_depths_match_the_oracle(unroll, pipe, head_dim, heads, monkeypatch):
    on_gpu.test_pipeline_depths_match_the_oracle(unroll, pipe, head_dim, heads, monkeypatch)


mma = on_gpu.mma  # (the GPU module's fixture: FLASHCUDA_DECODE_MMA=1 at 2 stages)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (12, 2), (32, 2)],
                         ids=["mha", "gqa4", "gqa6", "gqa16"])
@pytest.mark.parametrize("batch,keys", [(1, 1), (3, 77), (2, 1000)])
def test_mma_step_matches_the_oracle(dtype, head_dim, heads, batch, keys, mma):
    on_gpu.test_mma_step_matches_the_oracle(dtype, head_dim, heads, batch, keys, mma)


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_mma_step_spans_pages_rows(page_size, mma):
    on_gpu.test_mma_step_spans_pages_rows(page_size, mma)


def test_the_split_covers_one_and_many_pieces():
    on_gpu.test_the_split_covers_one_and_many_pieces()


@pytest.mark.parametrize("head_dim,heads", [(64, (8, 1)), (128, (12, 2)), (256, (16, 2))])
def test_combine_after_and_dependent(head_dim, heads, stages, monkeypatch):
    on_gpu.test_combine_after_and_dependent(head_dim, heads, stages, monkeypatch)


@pytest.mark.parametrize("quads", [1, 0])
@pytest.mark.parametrize("head_dim,heads", [(8, (8, 1)), (64, (8, 1)), (72, (12, 2)),
                                            (128, (24, 3)), (256, (16, 2))])
def test_combine_by_quads(head_dim, heads, quads, monkeypatch):
    on_gpu.test_combine_by_quads(head_dim, heads, quads, monkeypatch)


@pytest.mark.parametrize("per_sm", [1, 2])
def test_split_counting_ctas_per_sm(per_sm, monkeypatch):
    on_gpu.test_split_counting_ctas_per_sm(per_sm, monkeypatch)


def test_combine_launches(monkeypatch):
    """FLASHCUDA_DECODE_COMBINE=1: the split kernel of FC_COMBINE=1, then the combine kernel of
    FC_COMBINE=1, launched programmatically; 0: the plain split and combine kernels, one after
    the other."""
    launched = []
    run = simt_emu.EmuLaunch.__call__

    def record(self, *values, **kw):
        launched.append((self.kernel.name, self.asked_programmatic))
        return run(self, *values, **kw)

    monkeypatch.setattr(simt_emu.EmuLaunch, "__call__", record)
    q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 3000, 2, 64, dtype=q.dtype) for _ in range(2))
    for combine, names in ((1, ["flash_decode_bf16_d64_r4_mma_p4_cd",
                                "flash_decode_combine_bf16_cd_q4"]),
                           (0, ["flash_decode_bf16_d64_r4_mma_p4",
                                "flash_decode_combine_bf16_q4"])):
        monkeypatch.setattr(fwd_decode, "COMBINE", combine)
        monkeypatch.setattr(fwd_decode, "MMA_STAGES", 4)
        launched.clear()
        fwd_decode.attention(q, k, v, 0.125)
        assert [n for n, _ in launched] == names
        assert [p for _, p in launched] == [False] * (len(names) - 1) + [combine == 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_entry_counts_on_the_device(dtype, stages):
    on_gpu.test_per_entry_counts_on_the_device(dtype, stages)


@pytest.mark.parametrize("page_size", [1, 16, 7, 256])
def test_paged_cache_with_left_padding(page_size, stages):
    on_gpu.test_paged_cache_with_left_padding(page_size, stages)


def test_cache_rows_and_left_padding(stages):
    on_gpu.test_cache_rows_and_left_padding(stages)


@pytest.mark.parametrize("seqlen_q,causal", [(2, True), (5, True), (16, True), (3, False)])
def test_several_query_rows_per_sequence(seqlen_q, causal, stages):
    on_gpu.test_several_query_rows_per_sequence(seqlen_q, causal, stages)


def test_strided_cache_views(stages):
    on_gpu.test_strided_cache_views(stages)


def test_nan_stays_in_its_entry_and_kv_head(stages):
    on_gpu.test_nan_stays_in_its_entry_and_kv_head(stages)


@pytest.mark.parametrize("ragged", [False, True])
def test_kvcache_decode_one_call(ragged, monkeypatch, stages):
    on_gpu.test_kvcache_decode_one_call(ragged, monkeypatch, stages)


@pytest.mark.parametrize("new", [1, 4])
@pytest.mark.parametrize("layout", ["paged_leftpad", "rows_leftpad"])
def test_kvcache_spans_on_device_one_call(layout, new, monkeypatch, stages):
    on_gpu.test_kvcache_spans_on_device_one_call(layout, new, monkeypatch, stages)


def test_func_decode_runs_the_kernel(monkeypatch):
    on_gpu.test_func_decode_runs_the_kernel(monkeypatch)


def test_bitwise_deterministic_across_calls(stages):
    on_gpu.test_bitwise_deterministic_across_calls(stages)


# ---- the emulator has teeth ---------------------------------------------------------------------

def _decode_variant(monkeypatch, tmp_path, old: str, new: str) -> None:
    """fwd_decode's kernels built from a copy of flash_decode.cu with `old` replaced by `new`."""
    source = (simt_emu.KERNELS_DIR / fwd_decode.SOURCE).read_text()
    assert source.count(old) == 1, old
    (tmp_path / "attention").mkdir()
    (tmp_path / fwd_decode.SOURCE).write_text(source.replace(old, new))
    real = simt_emu.build

    def build(spec, resident=3):
        return real(spec, resident, kernels_dir=tmp_path)

    monkeypatch.setattr(fwd_decode, "get_kernel", lambda spec, device=None: build(spec))
    monkeypatch.setattr(fwd_decode, "_plans", type(fwd_decode._plans)(fwd_decode._plans.build))


def _one_call(stages, monkeypatch):
    """The lanes at `stages` (the tensor cores at 2 where the caller set MMA=1)."""
    monkeypatch.setattr(fwd_decode, "STAGES", stages)
    monkeypatch.setattr(fwd_decode, "MMA_STAGES", stages)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 700, 2, 64, generator=g).bfloat16() for _ in range(2))
    out, lse = fwd_decode.attention(q, k, v, 0.125)
    on_gpu.check_entries(out, lse, q, k, v, [700, 700], scale=0.125)


def test_a_stage_read_before_its_wait_is_caught(monkeypatch, tmp_path):
    """The pipeline waiting for one group fewer (the newest step's copies still in flight when
    its stage is read) gives NaN, where the kernel as written passes."""
    monkeypatch.setattr(fwd_decode, "MMA", 0)
    _one_call(3, monkeypatch)
    _decode_variant(monkeypatch, tmp_path, "cp_async_wait<kStages - 1>();  // step it's group",
                    "cp_async_wait<kStages>();  // step it's group")
    with pytest.raises(AssertionError):
        _one_call(3, monkeypatch)


def test_an_mma_stage_read_before_its_wait_is_caught(monkeypatch, tmp_path):
    """The same for the tensor-core step's per-warp pipeline (FLASHCUDA_DECODE_MMA)."""
    monkeypatch.setattr(fwd_decode, "MMA", 1)
    _one_call(2, monkeypatch)
    _decode_variant(monkeypatch, tmp_path, "cp_async_wait<kStages - 1>();\n    __syncwarp();",
                    "cp_async_wait<kStages>();\n    __syncwarp();")
    with pytest.raises(AssertionError):
        _one_call(2, monkeypatch)


def test_a_wrong_page_row_is_caught(monkeypatch, tmp_path):
    """A paged cache read one row off within its page fails the oracle."""
    monkeypatch.setattr(fwd_decode, "STAGES", 0)
    monkeypatch.setattr(fwd_decode, "MMA", 0)
    _decode_variant(monkeypatch, tmp_path, "(p - blk * page_size) * row_stride",
                    "((p + 1 - blk * page_size) % page_size) * row_stride")
    with pytest.raises(AssertionError):
        on_gpu.test_paged_cache_with_left_padding(16, 0)


_PROBE = r"""
extern "C" __global__ void FC_KERNEL_NAME(int* out, int mode) {
  __shared__ int cell[64];
  const int t = threadIdx.x;
  cell[t] = t;
  if (mode == 1 && t % 32 >= 16) return;  // half of each warp leaves before the shuffle
  int x = __shfl_xor_sync(0xffffffffu, t, 1);
  if (mode == 2 && t == 0) return;        // thread 0 leaves before the barrier
  __syncthreads();
  out[t] = x * 1000 + cell[63 - t];
}
"""


def test_the_emulator_runs_shuffles_and_barriers(tmp_path):
    """Lanes exchange through a shuffle, threads see each other's shared memory after a barrier,
    an exited thread counts at the barrier, and a shuffle some lanes never reach is reported."""
    (tmp_path / "probe.cu").write_text(_PROBE)
    kernel = simt_emu.build(KernelSpec.make("emu_probe", "probe.cu"), kernels_dir=tmp_path)
    for mode in (0, 2):
        out = torch.full((64,), -1, dtype=torch.int32)
        params = torch.tensor([out.data_ptr(), mode], dtype=torch.int64)  # (int* then int)
        kernel.run_packed(params.data_ptr(), (1, 1, 1), (64, 1, 1), 0)
        t = torch.arange(64)
        expect = (t ^ 1) * 1000 + (63 - t)
        if mode == 2:
            expect[0] = -1
        assert torch.equal(out.long(), expect), mode
    params = torch.tensor([out.data_ptr(), 1], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="deadlock"):
        kernel.run_packed(params.data_ptr(), (1, 1, 1), (64, 1, 1), 0)
