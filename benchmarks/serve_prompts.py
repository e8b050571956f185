"""Built-in prompts for serve_bench.py: 32 short chat prompts, deterministic ~1,000-token ones, and a GPU mix
of 128-1,024-token ones."""

from __future__ import annotations

import random

SHORT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous physicist and one thing they discovered.",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
    "What is photosynthesis?",
    "Suggest a name for a bakery.",
    "How do airplanes fly?",
    "What is the boiling point of water at sea level?",
    "Tell me a fun fact about octopuses.",
    "Explain recursion to a ten-year-old.",
    "Write a short thank-you note to a teacher.",
    "What are the benefits of drinking water?",
    "Give three ideas for a rainy afternoon.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the difference between weather and climate?",
    "Write a Python function that reverses a string.",
    "How do I make a cup of green tea?",
    "Rewrite this sentence more politely: 'Give me the report now.'",
    "What causes the seasons on Earth?",
    "Name five fruits that are red.",
    "Explain what a database index is.",
    "Write a two-line poem about autumn leaves.",
    "What should I pack for a weekend camping trip?",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.",
    "Give me a motivational quote and explain it briefly.",
    "What is the tallest mountain in the world, and where is it?",
]

_TOWNS = ["Alderbrook", "Bramwick", "Corrinth", "Dunmere", "Eastholt", "Fernvale", "Glenmoor", "Harrowgate"]
_ROLES = ["mayor", "baker", "librarian", "blacksmith", "schoolteacher", "harbour master", "doctor", "miller"]
_VERBS = ["repaired", "counted", "painted", "sold", "planted", "catalogued", "delivered", "inspected"]
_THINGS = ["barrels of apples", "old bridges", "fishing boats", "oak trees", "lanterns", "wool blankets",
           "copper kettles", "maps of the coast"]
_PLACES = ["river mill", "north gate", "market square", "lighthouse", "town hall", "stone quarry",
           "east orchard", "village well"]
_WEATHER = ["a cold wind blew from the hills", "the rain did not stop for three days",
            "the harvest was better than anyone expected", "a traveling circus passed through",
            "the river froze solid for a week", "a new road was opened to the south"]


def long_prompt(seed: int, sentences: int = 26) -> str:
    """A deterministic passage (~1,000 SmolLM2 tokens with the chat template) plus a question about it.

    Every seed gives a different passage from its first words on, so neither server can reuse a
    cached prefix from another request (beyond the chat template's system prompt).
    """
    rng = random.Random(seed)
    lines = [f"Chronicle {seed} of the valley towns."]
    facts = []
    for _ in range(sentences):
        town, role, verb = rng.choice(_TOWNS), rng.choice(_ROLES), rng.choice(_VERBS)
        n, thing, place = rng.randint(2, 90), rng.choice(_THINGS), rng.choice(_PLACES)
        year = rng.randint(1701, 1899)
        lines.append(f"In {year}, the {role} of {town} {verb} {n} {thing} near the {place}, "
                     f"and that year {rng.choice(_WEATHER)}.")
        facts.append((year, role, town))
    year, role, town = facts[rng.randrange(len(facts))]
    passage = " ".join(lines)
    return (f"Read the passage below and answer the question.\n\n{passage}\n\n"
            f"Question: according to the passage, what did the {role} of {town} do in {year}?")


def messages_for(variant: str, n: int, salt: int = 0) -> list[list[dict]]:
    """n chat requests of the given variant; salt makes long prompts unique per sweep point."""
    if variant == "short":
        return [[{"role": "user", "content": SHORT_PROMPTS[i % len(SHORT_PROMPTS)]}] for i in range(n)]
    if variant == "long":
        return [[{"role": "user", "content": long_prompt(salt * 100_003 + i)}] for i in range(n)]
    if variant == "mixed":  # 3-26 sentences: ~170 to ~1,000 tokens with the chat template, uniformly
        rng = random.Random(salt)
        return [[{"role": "user", "content": long_prompt(salt * 100_003 + i, rng.randint(3, 26))}] for i in range(n)]
    raise ValueError(f"unknown variant {variant!r}")
