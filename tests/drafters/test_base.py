"""The drafter interface's declared capabilities (`specjax.drafters.base`): every drafter class declares what the
runners ask of it, and the declarations say what the drafters do."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import specjax.drafters
from specjax.drafters.base import DEVICE_SIDE, DrafterBase, DrafterCapabilities, capabilities_of
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.suffix import SuffixDrafter
from specjax.drafters.with_lookup import WithLookup
from helpers import tiny_config


def drafter_classes(modules) -> list[type]:
    """Every class defined in `modules` that is a drafter: it has the interface's `tree` and `init` (a host-side
    drafter proposes through its host state, so `propose` is not the mark), protocols excluded."""
    found = []
    for module in modules:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            members = {name for klass in cls.__mro__ for name in vars(klass)} | set(getattr(cls, "__annotations__", {}))
            if cls.__module__ == module.__name__ and {"tree", "init"} <= members \
                    and not getattr(cls, "_is_protocol", False):
                found.append(cls)
    return found


def undeclared(classes) -> list[str]:
    """The classes whose capabilities are not declared: not derived from DrafterBase, or `capabilities` neither a
    DrafterCapabilities nor a property."""
    bad = []
    for cls in classes:
        declared = inspect.getattr_static(cls, "capabilities", None)
        if not issubclass(cls, DrafterBase) or not isinstance(declared, (DrafterCapabilities, property)):
            bad.append(cls.__name__)
    return bad


def _drafter_modules():
    return [importlib.import_module(f"specjax.drafters.{m.name}")
            for m in pkgutil.iter_modules(specjax.drafters.__path__)]


def test_every_drafter_declares_its_capabilities():
    classes = drafter_classes(_drafter_modules())
    names = {c.__name__ for c in classes}
    # The scan sees the drafters (an empty scan would pass trivially).
    assert {"NgramDrafter", "DraftModelDrafter", "SuffixDrafter", "MedusaDrafter", "EagleDrafter",
            "WithLookup"} <= names, names
    assert undeclared(classes) == []


def test_a_drafter_without_a_declaration_is_caught():
    """Planted: a drafter class outside DrafterBase, and one whose `capabilities` is a stray value."""
    import types

    planted = types.ModuleType("planted_drafters")

    class Loose:
        tree = None

        def init(self, *args): ...

    class Stray(DrafterBase):
        tree = None
        capabilities = {"host_side": True}

        def init(self, *args): ...

    for cls in (Loose, Stray):
        cls.__module__ = planted.__name__
        setattr(planted, cls.__name__, cls)
    assert undeclared(drafter_classes([planted])) == ["Loose", "Stray"]


def test_declared_capabilities_match_the_drafters():
    config = tiny_config(num_layers=1)
    assert NgramDrafter(4).capabilities == DEVICE_SIDE
    assert SuffixDrafter().capabilities.host_side
    assert not SuffixDrafter().capabilities.runs_draft_model
    draft = DraftModelDrafter(config, 3)
    assert draft.capabilities.draft_config is config and draft.capabilities.runs_draft_model
    assert not draft.capabilities.host_side
    # A capability is a declaration, not a dataclass field: it does not enter the drafter's hash or equality.
    assert "capabilities" not in {f.name for f in dataclasses.fields(SuffixDrafter)}
    assert "host_side" not in {f.name for f in dataclasses.fields(SuffixDrafter)}
    # A merged lookup drafts with its base, so it has the base's capabilities.
    merged = WithLookup(SuffixDrafter(num_speculative_tokens=8), NgramDrafter(2))
    assert merged.capabilities.host_side
    assert WithLookup(NgramDrafter(8), NgramDrafter(2)).capabilities == DEVICE_SIDE


def test_plain_decoding_has_the_default_capabilities():
    assert capabilities_of(None) == DEVICE_SIDE
    assert not DEVICE_SIDE.host_side and DEVICE_SIDE.draft_config is None
