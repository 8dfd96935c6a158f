"""The docstring examples of the pure modules run, as `pytest --doctest-modules` would run them:
policies/ and the shared models (and the settings model) say nothing their code does not do."""

import doctest
import importlib
import pkgutil

import pytest

import ckptflow.policies

MODULES = ["ckptflow.registry", "ckptflow.modes", "ckptflow.models", "ckptflow.results", "ckptflow.fleet",
           "ckptflow.settings", "ckptflow.container_models", "ckptflow.runners.engine", "ckptflow.runners.isolate", "ckptflow.runners.digests",
           "ckptflow.runners.gpu", "ckptflow.engines.kv_files", "ckptflow.engines.control", "ckptflow.engines.sglang_protocol",
           *sorted(m.name for m in pkgutil.iter_modules(ckptflow.policies.__path__, "ckptflow.policies."))]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=report.append)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, "".join(report)
    assert res.attempted > 0, f"{name} has no runnable example"
