"""What speculative generation keeps between calls on one LLM, as one typed object (`LLM.runtime`).

Two kinds of state, kept apart because a benchmark resets one and not the other:
  * about the hardware and the weights: built drafters (weights loaded, programs compiled once), the measured
    back-off break-even per (config, batch bucket), and which drafters' verify sizes are compiled;
  * learned from the requests: the back-off's gain priors and the suffix drafter's global index of earlier
    outputs (`learned_state` / `restore_learned`).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Hashable

SUFFIX_GLOBAL_SEQS = 256  # earlier generations kept in the global suffix cache (FIFO)


@dataclasses.dataclass
class SuffixGlobal:
    """The suffix drafter's index of earlier outputs and the id the next finished sequence gets in it."""

    index: Any  # drafters.suffix_tree.SuffixIndex
    next_id: int = 0


@dataclasses.dataclass
class SpecRuntime:
    """Caches and learned values of speculative generation for one target model.

    drafters: SpeculativeConfig -> (drafter, dparams).
    break_even: (SpeculativeConfig, batch bucket) -> the back-off break-even gain measured on this hardware.
    gain_priors: (SpeculativeConfig, batch bucket) -> mean accepted tokens per verify step of the last call.
    suffix_global: the suffix drafter's global index (None until a suffix generation ran).
    warmed: (drafter, state shapes) whose verify sizes and plain step are compiled.
    """

    drafters: dict = dataclasses.field(default_factory=dict)
    break_even: dict = dataclasses.field(default_factory=dict)
    gain_priors: dict = dataclasses.field(default_factory=dict)
    suffix_global: SuffixGlobal | None = None
    warmed: set = dataclasses.field(default_factory=set)

    def drafter(self, spec: Hashable, build: Callable[[], tuple]) -> tuple:
        """The (drafter, dparams) of `spec`, built by build() the first time. The whole frozen config is the
        key: any option may shape the drafter (suffix depth, tree choices, ...)."""
        if spec not in self.drafters:
            self.drafters[spec] = build()
        return self.drafters[spec]

    def suffix_index(self, max_depth: int) -> SuffixGlobal:
        """The global suffix index, created on first use."""
        if self.suffix_global is None:
            from specjax.drafters.suffix_tree import SuffixIndex

            self.suffix_global = SuffixGlobal(SuffixIndex(max_depth, max_sequences=SUFFIX_GLOBAL_SEQS))
        return self.suffix_global

    def learned_state(self) -> dict:
        """A deep copy of what one generation passes to the next (gain priors, suffix index); for
        `restore_learned`. Break-even floors and built drafters are not included: they describe the hardware
        and the weights, not the requests."""
        return copy.deepcopy({"gain_priors": self.gain_priors, "suffix_global": self.suffix_global})

    def restore_learned(self, saved: dict) -> None:
        """Put back a `learned_state` snapshot (a copy of it: the snapshot can be restored again); an empty
        dict forgets everything learned."""
        saved = copy.deepcopy(saved)
        self.gain_priors = saved.get("gain_priors", {})
        self.suffix_global = saved.get("suffix_global")

    def clear(self) -> None:
        """Forget everything: drafters, measured floors, learned values."""
        self.drafters.clear()
        self.break_even.clear()
        self.gain_priors.clear()
        self.suffix_global = None
        self.warmed.clear()
