"""The hybrid runtime: a Plan (or flags) -> a running MoEModel whose experts are split between
per-card GPU expert caches (grouped QPN kernel) and the CPU expert runner.

    session = open_session(model_dir, RuntimeOptions(device="cuda", gpus=(0, 0), layer_split=(24,)))
    res = generate(session.model, tok, ids, 64, sampler)      # session.model proxies MoEModel
    session.close(); print(session.stats.summary(res))
"""
from hybrid.runtime.options import RuntimeOptions
from hybrid.runtime.placement import CardSpec, Placement

__all__ = ["RuntimeOptions", "CardSpec", "Placement", "open_session"]


def __getattr__(name):  # lazy: keeps `import hybrid.runtime` free of torch-heavy imports
    if name == "open_session":
        from hybrid.runtime.session import open_session

        return open_session
    raise AttributeError(name)
