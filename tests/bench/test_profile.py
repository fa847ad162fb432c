"""bench/profile.py: kernel names fall into the groups the speed targets ask about."""

from bench.profile import group_of, idle_gaps, summarize


def test_kernels_are_grouped_by_kind():
    assert group_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert group_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN") == "gemm"
    assert group_of("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"  # a GEMM, counted as attention
    assert group_of("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>") == (
        "layer norm"
    )
    assert group_of("void cudnn::fusion::compute_dot_do_o<true>(void const*)") == "attention"
    assert group_of("void at::native::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16, float>") == "layer norm"
    assert group_of("void at::native::fused_dropout_kernel_vec<c10::BFloat16>") == "dropout"
    assert group_of("void multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert group_of("cunn_SoftMaxForward<4, float>") == "softmax / loss"
    assert group_of("something_new") == "other"


def test_summary_is_per_step_and_sorted():
    report = summarize({"gemm_a": 30.0, "gemm_b": 10.0, "layer_norm_x": 6.0, "zzz": 4.0}, wall_ms=100.0, steps=2)
    assert report["wall_ms_per_step"] == 50.0 and report["busy_ms_per_step"] == 25.0
    assert report["busy_share"] == 0.5
    assert list(report["groups_ms_per_step"].items()) == [("gemm", 20.0), ("layer norm", 3.0), ("other", 2.0)]
    assert report["top_kernels_ms_per_step"][0] == {"kernel": "gemm_a", "group": "gemm", "ms": 15.0}


def test_idle_gaps_are_the_stretches_no_kernel_covers():
    spans = [(0, 100, "a"), (50, 300, "b"), (1300, 1400, "c"), (1405, 1500, "d"), (1480, 1490, "e")]
    gaps = idle_gaps(spans)
    assert gaps["longest"] == [
        {"ms": 1.0, "after": "b", "before": "c"},  # 300 -> 1300 µs; "a" ended inside "b"
        {"ms": 0.005, "after": "c", "before": "d"},
    ]
    assert gaps["total_ms"] == 1.005
    assert gaps["by_size"][">= 1 ms"] == {"count": 1, "ms": 1.0}
    assert gaps["by_size"]["< 10 µs"] == {"count": 1, "ms": 0.005}
    assert gaps["by_size"]["10-100 µs"]["count"] == 0
