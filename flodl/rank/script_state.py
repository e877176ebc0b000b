"""The script's own state in a run's bundles: what ``run.register_state(name, obj)`` keeps.

A script registers objects with ``state_dict`` / ``load_state_dict`` (its LR
schedulers, a GradScaler, a counter of its own). Every bundle the rank writes
(a consensus checkpoint, ShutdownWithSave, an emergency save) keeps the
writing rank's copy of each, as JSON in the ``.optim`` file's ``train_state``
beside the optimizer's state (which is that rank's too): ``{"script": {name:
state}}``. A resumed run loads that one copy into every rank's object before
the first batch it trains.

The states are those of the moment the rank wrote the bundle, between two of
its batches: a script's end-of-epoch code that had not run yet (it runs when
the rank's next epoch begins) is not in them, and a resumed run that starts
in the next epoch does not run it (docs/script-mode.md#resume).

The two threads of a script rank never touch this at once (rank/bridge.py):
the script registers in its turn (or before ``prepare``, while the driver only
waits for it), the driver saves and resumes in its own.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from ..checkpoint.files import CheckpointError

log = logging.getLogger(__name__)


class ScriptState:
    """The objects a script registered, and the states a resumed bundle holds for them."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self._resumed: dict[str, Any] | None = None  # the bundle's states not yet loaded (None: not resumed)

    def register(self, name: str, obj: Any) -> None:
        """Keep ``obj``'s state in the bundles; a resumed run's saved state is loaded into it now.

        Raises:
            TypeError: ``name`` is not a non-empty string, ``obj`` lacks ``state_dict`` /
                ``load_state_dict``, or its state is not JSON.
            ValueError: ``name`` is already registered.
            CheckpointError: the bundle's state for ``name`` does not load into ``obj``.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"flodl: run.register_state(name, obj): name must be a non-empty string, got {name!r}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"flodl: run.register_state({name!r}, obj): obj needs state_dict() and load_state_dict(), got {type(obj).__name__}"
            )
        if name in self.objects:
            raise ValueError(f"flodl: run.register_state({name!r}, ...): that name is registered already")
        _as_json(name, obj.state_dict())  # refuse now what no bundle could hold
        self.objects[name] = obj
        if self._resumed is not None:
            self._load(name, obj)

    def resume(self, train_state: dict[str, Any]) -> None:
        """A resumed run's bundle was loaded: restore what is registered, keep the rest for later registrations.

        Raises:
            CheckpointError: a saved state does not load into its object.
        """
        self._resumed = dict(train_state.get("script") or {})
        for name, obj in self.objects.items():
            self._load(name, obj)

    def saved(self) -> dict[str, Any]:
        """What the bundle keeps: each registered object's state, by name."""
        return {"script": {name: _as_json(name, obj.state_dict()) for name, obj in self.objects.items()}}

    def _load(self, name: str, obj: Any) -> None:
        assert self._resumed is not None
        if name not in self._resumed:
            log.warning("the resumed bundle holds no state for run.register_state(%r): it starts afresh", name)
            return
        try:
            obj.load_state_dict(self._resumed.pop(name))
        except Exception as exc:
            raise CheckpointError(
                f"run.register_state({name!r}): the bundle's state does not load into it: {type(exc).__name__}: {exc}"
            ) from None


def _as_json(name: str, state: Any) -> Any:
    """``state`` as the bundle will hold it (a copy, so a later change to the object is not saved).

    Raises:
        TypeError: naming ``name``, when the state is not JSON (flodl writes no pickle).
    """
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"flodl: run.register_state({name!r}): its state_dict() must be JSON (numbers, strings, lists, dicts): {exc}"
        ) from None
    return copy.deepcopy(state)
