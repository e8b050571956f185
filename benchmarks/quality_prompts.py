"""The fixed prompt set of quant_quality.py: 576 chat prompts written for the benchmark, in 9 kinds.

Each kind is built from short fixed lists below (no randomness, nothing downloaded), so every run and
every machine scores the same prompts. `quality_prompts(n)` takes them round-robin across kinds, so a
quick run (--prompts 64) still covers every kind.
"""

from __future__ import annotations

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Portugal", "Japan", "China", "India", "Brazil", "Canada",
             "Mexico", "Egypt", "Kenya", "Australia", "Norway", "Sweden", "Poland", "Greece", "Turkey", "Peru",
             "Chile", "Argentina", "Vietnam", "Thailand", "Ireland", "Austria", "Belgium", "Finland", "Denmark",
             "Morocco", "Nigeria", "Indonesia"]
TOPICS = ["photosynthesis", "gravity", "inflation", "the water cycle", "vaccines", "black holes", "democracy",
          "the internet", "volcanoes", "climate change", "DNA", "electricity", "the stock market", "tides",
          "rainbows", "earthquakes", "the immune system", "compound interest", "machine learning", "recycling",
          "the moon's phases", "evolution", "magnets", "sleep", "coffee", "the Roman Empire", "jazz", "chess",
          "bread baking", "solar panels", "bees", "glaciers"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
              "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list",
              "computes the factorial of n", "checks whether a word is a palindrome", "flattens a nested list",
              "finds the largest element of a list", "converts Celsius to Fahrenheit", "sums the digits of an integer",
              "returns the GCD of two numbers", "sorts a list of tuples by their second item",
              "counts word frequencies in a text", "transposes a matrix", "checks whether brackets are balanced",
              "computes the mean and median of a list", "reads a CSV file into a list of dicts",
              "validates an email address with a regular expression", "implements binary search",
              "returns the intersection of two lists", "capitalizes every word in a sentence",
              "converts a Roman numeral to an integer", "chunks a list into pieces of size n",
              "computes the power set of a set", "rotates a list by k positions", "checks whether two strings are anagrams",
              "returns the second largest number in a list", "implements a stack class", "parses a date string",
              "computes the Levenshtein distance"]
LANGS = ["Python", "JavaScript", "C", "Rust"]
SNIPPETS = [
    "def add(a, b):\n    return a - b", "for i in range(10)\n    print(i)", "x = [1, 2, 3]\nprint(x[3])",
    "function f(a) { return a.lenght; }", "int main() { int x; printf(\"%d\", x); }",
    "SELECT name FROM users WHERE age > 30 ORDER BY", "while True:\n    pass", "import os\nos.remove('/')",
    "let v = vec![1, 2, 3];\nlet y = v[5];", "print('hello' + 5)", "if x = 3:\n    print(x)",
    "def mean(xs):\n    return sum(xs) / len(xs)", "const x = 5; x = 6;", "s = 'abc'\ns[0] = 'z'",
    "d = {}\nprint(d['key'])", "for (int i = 0; i <= n; i++) a[i] = 0;",
]
LIST_ITEMS = ["fruits", "planets", "programming languages", "European capitals", "musical instruments",
              "ocean animals", "primary colours", "famous painters", "types of clouds", "board games",
              "vegetables", "dog breeds", "chemical elements", "sports played with a ball", "kitchen tools",
              "birds", "trees", "rivers in Africa", "Greek gods", "mammals that live in water", "spices",
              "renewable energy sources", "parts of a computer", "Shakespeare plays", "desserts",
              "mountain ranges", "tips for studying", "ways to save money", "healthy breakfast ideas",
              "things to pack for a trip", "reasons to learn a language", "hobbies you can do at home"]
FOREIGN = [
    "Quelle est la capitale de l'Italie ?", "Comment faire une omelette ?", "Pourquoi le ciel est-il bleu ?",
    "Donne-moi trois conseils pour bien dormir.", "Qui a écrit Les Misérables ?", "Qu'est-ce qu'un volcan ?",
    "¿Cuál es la capital de Alemania?", "¿Cómo se hace una tortilla de patatas?", "¿Por qué llueve?",
    "Dame tres consejos para aprender inglés.", "¿Quién pintó la Mona Lisa?", "¿Qué es la fotosíntesis?",
    "Was ist die Hauptstadt von Spanien?", "Wie funktioniert ein Kühlschrank?", "Warum ist das Meer salzig?",
    "Nenne drei deutsche Dichter.", "Wer hat die Relativitätstheorie entwickelt?", "Was ist ein Planet?",
    "Qual è la capitale del Giappone?", "Come si prepara la pizza?", "Perché le foglie cadono in autunno?",
    "Qual é a capital do Brasil?", "Como funciona a internet?", "Quem descobriu o Brasil?",
    "Wat is de hoofdstad van Nederland?", "Hur många dagar har ett år?", "Ile to jest dwa plus dwa?",
    "Что такое гравитация?", "東京はどこの国の首都ですか？", "什么是人工智能？", "Bugün hava nasıl olacak?",
    "Apa ibu kota Indonesia?",
]
PHRASES = ["good morning", "thank you very much", "where is the train station?", "I love reading books",
           "the weather is nice today", "how much does this cost?", "see you tomorrow", "my name is Anna",
           "I would like a cup of tea", "happy birthday", "the cat is sleeping", "please open the window",
           "what time is it?", "I am learning to cook", "the museum is closed on Mondays", "good luck"]
TARGETS = ["French", "Spanish", "German", "Italian"]


def _numbers() -> list[str]:
    out = []
    for i in range(64):
        a, b = 3 + (i * 37) % 97, 2 + (i * 53) % 41
        form = i % 8
        out.append([f"What is {a} times {b}?", f"What is {a * 13} plus {b * 7}?", f"What is {a * b} divided by {b}?",
                    f"Is {a * 7 + b} a prime number?", f"What is {a} percent of {b * 50}?",
                    f"Convert {a} kilometres to miles.", f"If I buy {b} apples at {a} cents each, how much do I pay?",
                    f"Count from {a} to {a + 6}."][form])
    return out


def _kinds() -> dict[str, list[str]]:
    return {
        "capitals": [f"What is the capital of {c}?" for c in COUNTRIES]
        + [f"Tell me one interesting fact about {c}." for c in COUNTRIES],
        "explain": [f"Explain {t} in simple terms." for t in TOPICS] + [f"Why does {t} matter?" for t in TOPICS],
        "code": [f"Write a {LANGS[i % 4]} function that {t}." for i, t in enumerate(CODE_TASKS)]
        + [f"Write a Python one-liner that {t}." for t in CODE_TASKS],
        "code_fix": [f"What is wrong with this code?\n```\n{s}\n```" for s in SNIPPETS]
        + [f"Explain what this code does:\n```\n{s}\n```" for s in SNIPPETS]
        + [f"Rewrite this code in a cleaner way:\n```\n{s}\n```" for s in SNIPPETS]
        + [f"Add comments to this code:\n```\n{s}\n```" for s in SNIPPETS],
        "lists": [f"List five {x}." for x in LIST_ITEMS] + [f"Name three {x}, one per line." for x in LIST_ITEMS],
        "numbers": _numbers(),
        "other_languages": FOREIGN + [f"Réponds en français : {q}" for q in
                                      [f"what is the capital of {c}?" for c in COUNTRIES[:32]]],
        "translate": [f"Translate '{p}' into {t}." for t in TARGETS for p in PHRASES],
        "writing": [f"Write a haiku about {t}." for t in TOPICS] + [f"Write one sentence that uses the word '{w}'."
                    for w in ["river", "quiet", "bright", "gentle", "storm", "garden", "window", "journey", "silver",
                              "promise", "shadow", "whisper", "forest", "candle", "harbor", "meadow", "thunder",
                              "lantern", "echo", "velvet", "horizon", "pebble", "frost", "ember", "canyon", "orbit",
                              "marble", "breeze", "compass", "island", "autumn", "mirror"]],
    }


KINDS = _kinds()


def quality_prompts(n: int) -> list[tuple[str, str]]:
    """The first n (kind, prompt) pairs, round-robin across kinds."""
    longest = max(len(v) for v in KINDS.values())
    order = [(k, v[i]) for i in range(longest) for k, v in KINDS.items() if i < len(v)]
    if n > len(order):
        raise ValueError(f"the prompt set has {len(order)} prompts")
    return order[:n]
