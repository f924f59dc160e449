"""A built-in set of chat instructions: coding, explanations, writing, advice, lists and short facts.

Every instruction is one template filled with one topic of its category. The set is deterministic (a fixed seed,
no randomness at import time beyond that), so every machine builds the same lists. `train_prompts()` and
`heldout_prompts()` split it by (template, topic) pair: no held-out pair, and no held-out string, appears in the
training list. Plain instructions are returned; apply the target's chat template when tokenizing them.
"""
from __future__ import annotations

import random

SEED = 20241203
HELDOUT_FRACTION = 0.1
TARGET_SIZE = 1000

_CODING_TEMPLATES = (
    "Write a Python function that {t}.",
    "Write a JavaScript function that {t}.",
    "Show me how to write a function that {t}, with a short explanation.",
    "Write a short Python script that {t}, and explain how it works.",
    "What is the most efficient way to write code that {t}?",
    "Write a C function that {t}.",
)
_CODING_TOPICS = (
    "checks whether a number is prime", "reverses a string", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "sorts a list of numbers with bubble sort", "finds the largest element in a list",
    "removes duplicates from a list", "checks whether a word is a palindrome", "computes the factorial of a number",
    "merges two sorted lists", "converts Celsius to Fahrenheit", "counts the words in a sentence",
    "finds the greatest common divisor of two numbers", "flattens a nested list", "capitalizes every word in a sentence",
    "checks whether two strings are anagrams", "computes the average of a list of numbers",
    "returns the second largest number in a list", "performs a binary search on a sorted list",
    "reads a text file and counts its lines", "generates a random password", "checks whether a year is a leap year",
    "converts a decimal number to binary", "finds the most common element in a list", "sums the digits of a number",
    "validates an email address", "rotates a list by k positions", "finds all even numbers in a list",
    "computes the power of a number without using the built-in operator", "splits a list into chunks of size n",
)

_EXPLAIN_TEMPLATES = (
    "Explain {t} in simple terms.",
    "What do you know about {t}?",
    "Walk me through the basics of {t}.",
    "Why should I care about {t}?",
    "Give me a short overview of {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the main ideas behind {t}?",
)
_EXPLAIN_TOPICS = (
    "photosynthesis", "gravity", "black holes", "the water cycle", "machine learning", "the internet",
    "inflation", "vaccines", "climate change", "the stock market", "DNA", "electricity", "recursion in programming",
    "the immune system", "supply and demand", "plate tectonics", "the greenhouse effect", "blockchain",
    "the theory of evolution", "compound interest", "the solar system", "neural networks", "democracy",
    "the Pythagorean theorem", "renewable energy", "the human heart", "encryption", "the scientific method",
    "operating systems", "sound waves", "the moon's phases", "antibiotics", "cloud computing", "rainbows",
)

_WRITING_TEMPLATES = (
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write a short story about {t}.",
    "Write a paragraph describing {t}.",
    "Write a short blog post introduction about {t}.",
    "Write a limerick about {t}.",
)
_WRITING_TOPICS = (
    "the ocean", "a rainy day", "friendship", "the first day of spring", "a lost cat", "the city at night",
    "a cup of coffee", "mountains", "an old library", "a robot learning to paint", "autumn leaves", "the stars",
    "a summer vacation", "a lighthouse", "a busy kitchen", "a quiet forest", "a birthday party", "the desert",
    "a train journey", "a snowy morning", "a small village", "a garden", "the moon", "a thunderstorm",
    "a dog at the beach", "a childhood memory", "a new job", "a market square", "a river", "a long walk home",
)

_ADVICE_TEMPLATES = (
    "How can I {t}?",
    "Give me some tips to {t}.",
    "What is the best way to {t}?",
    "I want to {t}. Where should I start?",
    "What are common mistakes people make when they try to {t}?",
)
_ADVICE_TOPICS = (
    "sleep better", "learn a new language", "save money", "improve my writing", "stay focused while studying",
    "start running", "reduce stress", "prepare for a job interview", "learn to cook", "be more productive",
    "make new friends", "learn to program", "eat healthier", "read more books", "manage my time",
    "speak in public with confidence", "keep a plant alive", "organize my room", "learn to play the guitar",
    "start a small business", "write a good resume", "drink more water", "become a better listener",
    "plan a trip on a budget", "improve my memory",
)

_LIST_TEMPLATES = (
    "List five {t}.",
    "Name three {t}.",
    "Give me a list of {t}.",
    "What are some {t}?",
    "Give me ten {t}, one per line.",
)
_LIST_TOPICS = (
    "fruits that are high in vitamin C", "programming languages", "famous painters", "ways to reduce plastic waste",
    "healthy breakfast ideas", "board games for families", "countries in South America", "uses of a paperclip",
    "benefits of exercise", "planets in the solar system", "musical instruments", "ideas for a rainy weekend",
    "classic novels", "birds that cannot fly", "tips for a good night's sleep", "vegetables that grow quickly",
    "inventions that changed the world", "ways to stay warm in winter", "popular sports", "words that rhyme with light",
    "questions to ask in an interview", "things to pack for a camping trip", "data structures in computer science",
    "renewable sources of energy", "names for a pet goldfish",
)

_FACT_TEMPLATES = (
    "What is the capital of {t}?",
    "Tell me one interesting fact about {t}.",
    "What language is spoken in {t}?",
    "Where is {t} located?",
)
_FACT_TOPICS = (
    "France", "Japan", "Brazil", "Canada", "Australia", "Egypt", "India", "Germany", "Mexico", "Kenya", "Italy",
    "Norway", "Argentina", "Spain", "Thailand", "Peru", "Greece", "Ireland", "Vietnam", "Portugal", "Chile",
    "Sweden", "Morocco", "Poland", "Turkey",
)

_SHORT_TEMPLATES = (
    "In one sentence, what is {t}?",
    "How many {t}?",
)
_SHORT_TOPICS_WHAT = (
    "the speed of light", "the largest ocean", "the boiling point of water", "a prime number", "a noun",
    "the tallest mountain", "an atom", "a verb", "the Milky Way", "a mammal",
)
_SHORT_TOPICS_HOW_MANY = (
    "days are in a leap year", "legs does a spider have", "continents are there", "minutes are in a day",
    "sides does a hexagon have", "planets are in the solar system", "bones are in the human body",
    "strings does a violin have", "players are on a soccer team", "hours are in a week",
)

CATEGORIES = {
    "coding": (_CODING_TEMPLATES, _CODING_TOPICS),
    "explain": (_EXPLAIN_TEMPLATES, _EXPLAIN_TOPICS),
    "writing": (_WRITING_TEMPLATES, _WRITING_TOPICS),
    "advice": (_ADVICE_TEMPLATES, _ADVICE_TOPICS),
    "list": (_LIST_TEMPLATES, _LIST_TOPICS),
    "fact": (_FACT_TEMPLATES, _FACT_TOPICS),
}


def _pairs() -> list[tuple[str, str, str]]:
    """Every (category, template, topic) triple, in a fixed order."""
    out = [(name, tpl, topic) for name, (templates, topics) in CATEGORIES.items()
           for tpl in templates for topic in topics]
    out += [("short", _SHORT_TEMPLATES[0], t) for t in _SHORT_TOPICS_WHAT]
    out += [("short", _SHORT_TEMPLATES[1], t) for t in _SHORT_TOPICS_HOW_MANY]
    return out


_CACHE: dict[str, list[str]] = {}


def _split() -> tuple[list[str], list[str]]:
    if not _CACHE:
        rng = random.Random(SEED)
        pairs = _pairs()
        # Keep every category represented: sample each one proportionally down to TARGET_SIZE in all.
        by_cat: dict[str, list] = {}
        for p in pairs:
            by_cat.setdefault(p[0], []).append(p)
        keep_frac = min(1.0, TARGET_SIZE / len(pairs))
        chosen = []
        for name in sorted(by_cat):
            group = by_cat[name]
            chosen += rng.sample(group, max(1, round(len(group) * keep_frac)))
        rng.shuffle(chosen)
        seen, unique = set(), []
        for cat, tpl, topic in chosen:
            text = tpl.format(t=topic)
            if text not in seen:
                seen.add(text)
                unique.append((cat, tpl, topic, text))
        n_held = max(1, round(len(unique) * HELDOUT_FRACTION))
        held = unique[:n_held]
        held_pairs = {(tpl, topic) for _, tpl, topic, _ in held}
        train = [u for u in unique[n_held:] if (u[1], u[2]) not in held_pairs]
        _CACHE["train"] = [u[3] for u in train]
        _CACHE["heldout"] = [u[3] for u in held]
    return _CACHE["train"], _CACHE["heldout"]


def train_prompts() -> list[str]:
    """The training instructions (about 90 % of the set), in a fixed shuffled order."""
    return list(_split()[0])


def heldout_prompts() -> list[str]:
    """The held-out instructions (about 10 %): no string and no (template, topic) pair is shared with training."""
    return list(_split()[1])
