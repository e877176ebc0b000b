"""The bundled example tasks build, have the advertised shapes, and learn.

Each example is trained in a plain single-process loop (no flodl runtime),
batching with ``default_collate`` as flodl's ranks do, so a failure here is
the example's fault, not the distributed machinery's.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CPU = torch.device("cpu")
NO_SKLEARN = "scikit-learn not installed (pip install 'flodl[examples]')"

# The examples import flodl; make the checkout importable when flodl is not installed.
if importlib.util.find_spec("flodl") is None:
    sys.path.insert(0, str(REPO))


def _load(name: str, fresh: bool = False) -> types.ModuleType:
    """Import ``examples/<name>.py`` by path, the way flodl resolves ``file.py:task``.

    Registered in ``sys.modules`` so its functions pickle by reference, and
    reused across tests so the examples' data caches are loaded once; pass
    ``fresh`` for a new module object with empty caches.
    """
    mod_name = f"_flodl_example_{name}"
    if not fresh and mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not fresh:
        sys.modules[mod_name] = module
    return module


def _train(task, *, epochs: int | None = None, max_steps: int | None = None, seed: int = 0):
    """Plain training loop: shuffle, collate, ``loss_fn(model(x), y)``, step.

    Returns ``(model, losses)``; stops after ``max_steps`` steps if given.
    """
    dataset = task.build_dataset()
    model = task.model()
    optimizer = task.optimizer(model)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for _ in range(epochs) if epochs is not None else itertools.count():
        for idx in torch.randperm(len(dataset), generator=gen).split(task.batch_size):
            x, y = default_collate([dataset[i] for i in idx.tolist()])
            loss = task.loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if max_steps is not None and len(losses) >= max_steps:
                return model, losses
    return model, losses


def _example_names() -> list:
    """Both examples; digits is skipped (not failed) where scikit-learn is missing."""
    no_sklearn = importlib.util.find_spec("sklearn") is None
    return [
        pytest.param("digits", marks=pytest.mark.skipif(no_sklearn, reason=NO_SKLEARN)),
        "charlm",
    ]


def test_digits_dataset_and_learns() -> None:
    pytest.importorskip("sklearn", reason=NO_SKLEARN)
    digits = _load("digits")
    task = digits.task()
    assert task.eval_metric == "accuracy" and task.batch_size == 32

    dataset = task.build_dataset()
    assert len(dataset) == 1500
    x, y = dataset[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64
    images, labels = dataset.tensors
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert set(labels.tolist()) == set(range(10))
    _, _, x_test, _ = digits._splits()
    assert len(x_test) == 1797 - 1500

    before = task.eval_fn(task.model(), CPU)
    model, _ = _train(task, epochs=3)
    after = task.eval_fn(model, CPU)
    assert before < 0.3, f"untrained model should be near chance, got {before:.3f}"
    assert after >= 0.90, f"accuracy after 3 epochs: {after:.3f}"


def test_digits_is_cached_and_deterministic() -> None:
    pytest.importorskip("sklearn", reason=NO_SKLEARN)
    digits = _load("digits")
    # A second task() must not reload the data (ranks and tests call it repeatedly).
    assert digits.task().dataset.tensors[0] is digits.task().dataset.tensors[0]
    # The split is a pure function of SEED: a fresh module rebuilds the same one.
    for cached, rebuilt in zip(digits._splits(), _load("digits", fresh=True)._splits(), strict=False):
        assert torch.equal(cached, rebuilt)


def test_digits_without_sklearn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import raise ImportError.
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    digits = _load("digits", fresh=True)  # importing the file itself must still work
    with pytest.raises(ImportError, match=r"pip install 'flodl\[examples\]'"):
        digits.task()


def test_charlm_dataset_and_learns() -> None:
    charlm = _load("charlm")
    task = charlm.task()
    assert task.eval_metric == "char_accuracy" and task.batch_size == 32

    dataset = task.build_dataset()
    assert 1000 <= len(dataset) <= charlm.MAX_TRAIN_WINDOWS
    x, y = dataset[0]
    assert x.shape == y.shape == (charlm.CONTEXT,)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1]), "targets are the inputs shifted by one character"
    inputs, targets = dataset.tensors
    assert int(inputs.min()) >= 0 and int(targets.max()) < charlm.VOCAB_SIZE
    _, _, x_eval, _ = charlm._data()
    assert 0 < len(x_eval) <= charlm.MAX_EVAL_WINDOWS

    before = task.eval_fn(task.model(), CPU)
    model, losses = _train(task, max_steps=150)
    after = task.eval_fn(model, CPU)
    # ln(vocab) ~ 4.57 is the loss of a uniform guess; a model that has learned
    # character frequencies and common bigrams is well below that (~1.9 here).
    assert sum(losses[-20:]) / 20 < 2.5, f"loss after 150 steps: {losses[-20:]}"
    assert after >= 0.45 and after >= before + 0.25, f"char accuracy {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("name", _example_names())
def test_example_is_importable_by_name(name: str, capsys: pytest.CaptureFixture) -> None:
    module = _load(name, fresh=True)
    assert capsys.readouterr().out == "", "examples must not print at import"
    assert module.__doc__ and "flodl.controller --task" in module.__doc__

    task = module.task()
    # flodl may reference each callable by name: none may be a lambda or closure.
    for field in ("model", "optimizer", "loss_fn", "eval_fn"):
        fn = getattr(task, field)
        assert "<" not in fn.__qualname__, f"Task.{field} is not top-level: {fn.__qualname__}"
        owner = module if fn.__module__ == module.__name__ else sys.modules[fn.__module__]
        assert getattr(owner, fn.__qualname__) is fn

    # Replicas start identical even before flodl syncs them from rank 0.
    first, second = task.model().state_dict(), task.model().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("name", _example_names())
def test_example_eval_fn_restores_mode(name: str) -> None:
    task = _load(name).task()
    model = task.model()
    value = task.eval_fn(model, CPU)
    assert isinstance(value, float) and 0.0 <= value <= 1.0
    assert model.training, "eval_fn must hand the model back in train mode"
    model.eval()
    task.eval_fn(model, CPU)
    assert not model.training, "eval_fn must not switch an eval-mode model to training"
