

def test_git_sha_prefers_hybrid_git_sha(monkeypatch):
    """A device copy may carry a stale .git: the sha passed in HYBRID_GIT_SHA is the one recorded."""
    from hybrid.baselines.report import git_sha

    monkeypatch.setenv("HYBRID_GIT_SHA", "0123456789abcdef")
    assert git_sha() == "0123456" and git_sha(short=False) == "0123456789abcdef"
    monkeypatch.delenv("HYBRID_GIT_SHA")
    assert git_sha() != "0123456"
