"""hybrid.switches: the HYBRID_* switches' one reading (default on unset or empty, stripped and lower-cased, a bad
value a one-line HybridError naming the variable) and a few of the switches that go through it."""
import pytest

from hybrid.errors import HybridError
from hybrid.switches import env_choice, env_flag


def test_env_choice(monkeypatch):
    monkeypatch.delenv("HYBRID_TEST_SWITCH", raising=False)
    assert env_choice("HYBRID_TEST_SWITCH", ("a", "b"), "a") == "a"
    monkeypatch.setenv("HYBRID_TEST_SWITCH", "  ")
    assert env_choice("HYBRID_TEST_SWITCH", ("a", "b"), "a") == "a"
    monkeypatch.setenv("HYBRID_TEST_SWITCH", " B ")
    assert env_choice("HYBRID_TEST_SWITCH", ("a", "b"), "a") == "b"
    monkeypatch.setenv("HYBRID_TEST_SWITCH", "c")
    with pytest.raises(HybridError, match=r"^HYBRID_TEST_SWITCH='c': expected one of a, b$"):
        env_choice("HYBRID_TEST_SWITCH", ("a", "b"), "a")
    with pytest.raises(HybridError, match=r"^HYBRID_TEST_SWITCH='c': expected a \(first\) or b$"):
        env_choice("HYBRID_TEST_SWITCH", ("a", "b"), "a", "a (first) or b")


@pytest.mark.parametrize("value,default,want", [
    (None, True, True), (None, False, False), ("", False, False), ("0", True, False), ("off", True, False),
    (" No ", True, False), ("false", True, False), ("1", False, True), ("yes", False, True), ("on", False, True),
])
def test_env_flag(monkeypatch, value, default, want):
    if value is None:
        monkeypatch.delenv("HYBRID_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("HYBRID_TEST_FLAG", value)
    assert env_flag("HYBRID_TEST_FLAG", default) is want


def test_switches_through_it(monkeypatch):
    """Switches read through hybrid.switches keep their values and messages."""
    from hybrid.kernels import build, fused, qpn
    from hybrid.model.layers import sdpa_gqa_mode
    from hybrid.runtime.graphs import graphs_enabled
    from hybrid.runtime.store_stage import source_mode, stage_kernel_enabled

    monkeypatch.setenv("HYBRID_QPN_TB", "MT")
    assert qpn.tb_mode() == "mt"
    monkeypatch.delenv("HYBRID_MOE_REDUCE", raising=False)
    assert qpn.moe_reduce() == "atomic"
    monkeypatch.setenv("HYBRID_MOE_REDUCE", "Ordered")
    assert qpn.moe_reduce() == "ordered"
    monkeypatch.setenv("HYBRID_MOE_REDUCE", "exact")
    with pytest.raises(HybridError, match="HYBRID_MOE_REDUCE='exact'"):
        qpn.moe_reduce()
    monkeypatch.setenv("HYBRID_SDPA_GQA", "auto")
    assert sdpa_gqa_mode() is None
    monkeypatch.setenv("HYBRID_SDPA_GQA", "expand")
    assert sdpa_gqa_mode() == "expand"
    monkeypatch.setenv("HYBRID_SDPA_GQA", "both")
    with pytest.raises(HybridError, match="HYBRID_SDPA_GQA='both': expected auto, native"):
        sdpa_gqa_mode()
    monkeypatch.setenv("HYBRID_STAGE_KERNEL", "2")
    with pytest.raises(HybridError, match="HYBRID_STAGE_KERNEL='2'"):
        stage_kernel_enabled()
    monkeypatch.setenv("HYBRID_PREFILL_SOURCE", "disk")
    with pytest.raises(HybridError, match="HYBRID_PREFILL_SOURCE='disk': expected one of store, checkpoint"):
        source_mode()
    monkeypatch.setenv("HYBRID_QPN_L2", "keep")
    with pytest.raises(HybridError, match="HYBRID_QPN_L2='keep'"):
        build.l2_mode(90)
    monkeypatch.setenv("HYBRID_ROUTE_RANK", "sorted")
    with pytest.raises(HybridError, match="HYBRID_ROUTE_RANK='sorted'"):
        fused.route_rank()
    monkeypatch.setenv("HYBRID_CUDA_GRAPHS", "off")
    assert graphs_enabled() is False
