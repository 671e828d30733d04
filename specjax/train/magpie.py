"""Self-generated instructions (Magpie-style): the target writes the user's message itself.

The chat template is rendered up to the start of the user's turn, followed by a short opener of one of the task
categories below (or none at all), and the target continues, sampled, until it closes the turn. The opener
steers the category; what follows is the target's own. Candidates are then cleaned: cut at the end of the turn,
length and character filters, a repetition filter, and exact deduplication after normalising case and space.

Nothing here is benchmark text: the openers are written for specjax and say only how a request begins.
"""
from __future__ import annotations

import dataclasses
import re
import unicodedata

import numpy as np

# (category, openers). "" lets the target start the message itself (pure Magpie).
OPENERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("chat", ("", "", "Hi! ", "Hey, ", "I have a question: ", "Can you help me ", "What do you think about ",
              "I'm feeling ", "Tell me ")),
    ("writing", ("Write a short story about ", "Write a poem about ", "Write an email to ", "Write a blog post about ",
                 "Draft a letter ", "Write a product description for ", "Write a speech ", "Compose a ",
                 "Write a paragraph ")),
    ("coding", ("Write a Python function that ", "How do I ", "Write a program that ", "Explain this code: ",
                "Write a JavaScript function ", "What is the difference between ", "Fix the bug in ",
                "Write a SQL query ", "Write a class ", "In Python, how can I ")),
    ("math", ("Solve: ", "A train ", "If a ", "What is ", "Calculate ", "Find the value of x ", "Sarah has ",
              "How many ", "A store sells ", "Prove that ")),
    ("reasoning", ("Why ", "What would happen if ", "Which is better, ", "Is it true that ", "If all ",
                   "Explain the logic behind ", "What are the pros and cons of ", "Compare ")),
    ("explain", ("Explain ", "What is ", "How does ", "Describe ", "Can you explain ", "What are ", "Teach me ",
                 "Give me an overview of ")),
    ("advice", ("How can I ", "What should I do ", "Give me tips ", "What are some ways to ", "I want to learn ",
                "Suggest ", "Recommend ", "Help me plan ")),
    ("extraction", ("Extract the ", "List all the ", "From the following text, ", "Identify the ",
                    "Classify the following ", "Find the names in ", "Summarize the key points of ")),
    ("translation", ("Translate into French: ", "Translate into Spanish: ", "Translate into German: ",
                     "Translate this sentence to Italian: ", "How do you say ", "Translate the following into English: ",
                     "Translate into Portuguese: ")),
    ("rewrite", ("Rewrite this sentence ", "Make this more formal: ", "Paraphrase: ", "Correct the grammar: ",
                 "Simplify this paragraph: ", "Summarize this: ")),
)

CATEGORIES = tuple(c for c, _ in OPENERS)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One instruction to be written: its id, category and opener."""

    id: int
    category: str
    opener: str


def plan_candidates(n: int, seed: int) -> list[Candidate]:
    """n candidates, categories round-robin, openers drawn with a fixed seed (the same list on every run)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        cat, ops = OPENERS[i % len(OPENERS)]
        out.append(Candidate(i, cat, ops[int(rng.integers(len(ops)))]))
    return out


def user_prefix(tokenizer) -> str:
    """The chat template rendered up to where the user's message begins (system prompt included if the
    template adds one)."""
    mark = "\u2063MAGPIE\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=False)
    cut = text.find(mark)
    if cut < 0:
        from specjax.train.shards import ShardError

        raise ShardError("the chat template does not show the user's message verbatim; Magpie prompts need it")
    return text[:cut]


_WORD = re.compile(r"\w+", re.UNICODE)


def normalise(text: str) -> str:
    return " ".join(_WORD.findall(unicodedata.normalize("NFKC", text).lower()))


def clean(text: str, *, min_chars: int = 12, max_chars: int = 1200) -> str | None:
    """The instruction text, or None when it is unusable: too short or long, mostly non-letters, not mostly
    Latin script (the prompts are meant to be in English, translations aside), or repeating itself."""
    t = text.strip()
    if not (min_chars <= len(t) <= max_chars):
        return None
    letters = sum(ch.isalpha() for ch in t)
    if letters < 0.5 * len(t.replace(" ", "")):
        return None
    latin = sum(ch.isascii() for ch in t if ch.isalpha())
    if latin < 0.8 * max(letters, 1):
        return None
    words = _WORD.findall(t.lower())
    if len(words) < 3:
        return None
    # A message that loops ("the the the ...", a phrase over and over) teaches nothing.
    if len(set(words)) < 0.4 * len(words):
        return None
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    if grams and max(grams.count(g) for g in set(grams)) > 3:
        return None
    return t


def dedupe(items: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """Keep the first of each (id, category, text) whose normalised text was not seen before."""
    seen: set[str] = set()
    out = []
    for i, cat, text in items:
        key = normalise(text)
        if key and key not in seen:
            seen.add(key)
            out.append((i, cat, text))
    return out
