"""Prompts the target answers to make its draft's training data.

Four sources, all offline: the Spec-Bench dev split minus the prompts the
benchmarks use (the first `held_out` of each category stay unseen, and are the
validation split); prompts written here from templates across the kinds of
requests the product serves (writing, role play, explanation, questions,
reasoning, arithmetic, code, translation, extraction); and requests about a
passage (summaries, questions on it, extraction, rewriting), whose passages are
the target's own earlier answers, so that a draft sees answers that read and
quote a long prompt; and requests the target writes itself when its chat
template's user turn is left open (as Magpie does), far more varied than
templates. Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

TOPICS = [
    "the history of tea", "renewable energy", "city gardening", "the ocean's deep sea creatures", "learning a new "
    "language", "remote work", "the first moon landing", "bees and pollination", "volcanoes", "ancient Rome",
    "machine learning", "climate change", "the printing press", "healthy sleep habits", "electric cars",
    "the Silk Road", "jazz music", "photosynthesis", "the human immune system", "chess strategy", "urban cycling",
    "the invention of the telephone", "coral reefs", "budget travel in Europe", "the Renaissance", "black holes",
    "baking bread at home", "mountain hiking safety", "the water cycle", "public libraries", "video game design",
    "the Industrial Revolution", "minimalist living", "honeybees", "space telescopes", "recycling plastics",
    "the Great Wall of China", "mindfulness meditation", "marathon training", "the stock market", "dinosaurs",
    "solar panels", "smartphone addiction", "volunteering", "the Olympic Games", "antibiotics", "desert ecosystems",
    "classical music", "3D printing", "the French Revolution", "rainforests", "coffee culture", "robotics",
]
PERSONAS = [
    "a pirate captain", "a medieval knight", "a friendly librarian", "a detective in 1920s London", "a space "
    "station engineer", "a chef in a busy restaurant", "a travel guide in Kyoto", "a wise old wizard",
    "a high school science teacher", "a sports coach", "a museum curator", "a lighthouse keeper",
    "a startup founder", "a park ranger", "a famous poet", "a time traveler from the year 3000",
]
QUESTIONS = [
    "What advice would you give to someone just starting out?", "What is the hardest part of your work?",
    "Tell me about the most memorable day of your life.", "How do you deal with difficult people?",
    "What do you enjoy most about what you do?", "Describe your favourite place.",
]
SCIENCE = [
    "photosynthesis", "gravity", "DNA replication", "the greenhouse effect", "vaccines", "plate tectonics",
    "nuclear fusion", "electric circuits", "the speed of light", "evaporation", "magnetism", "natural selection",
    "the immune response", "sound waves", "the periodic table", "chemical bonds", "entropy", "rainbows",
    "black holes", "neurons", "enzymes", "tides", "semiconductors", "the Doppler effect",
]
PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("Python", "Java"), ("trains", "planes"), ("books", "films"),
    ("renting", "buying a home"), ("summer", "winter"), ("democracy", "monarchy"), ("mitosis", "meiosis"),
    ("weather", "climate"), ("viruses", "bacteria"), ("solar power", "wind power"),
]
PEOPLE = [
    "Marie Curie", "Leonardo da Vinci", "Isaac Newton", "Cleopatra", "Ada Lovelace", "Nelson Mandela",
    "Albert Einstein", "Confucius", "Frida Kahlo", "Charles Darwin", "Mahatma Gandhi", "Galileo Galilei",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a text", "removes duplicates from a list while keeping order", "merges two sorted lists",
    "finds the largest element in a list", "converts Celsius to Fahrenheit", "checks whether a string is a "
    "palindrome", "computes the factorial of a number", "flattens a nested list", "sorts a list of dictionaries "
    "by a key", "reads a CSV file and returns its rows", "returns the most common element of a list",
    "validates an email address with a regular expression", "computes the average of a list of numbers",
]
SENTENCES = [
    "The weather is beautiful today.", "Where is the nearest train station?", "I would like a cup of coffee, "
    "please.", "My brother lives in a small village near the sea.", "The meeting has been moved to Thursday.",
    "Can you help me carry these boxes?", "We are planning a trip to the mountains next summer.",
    "The museum is closed on Mondays.", "She has been learning to play the piano for three years.",
    "Please turn off the lights when you leave the room.", "The children are playing in the garden.",
    "This book was written more than a hundred years ago.", "How much does this jacket cost?",
    "The restaurant on the corner serves excellent fish.", "I forgot my umbrella at the office.",
]
LANGUAGES = ["German", "French", "Spanish", "Italian"]
ITEMS = ["apples", "notebooks", "tickets", "pencils", "cupcakes", "plants", "books", "shirts"]
NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lucas", "Priya", "Omar", "Elena"]


def template_prompts(rng: random.Random) -> list[tuple[str, str]]:
    """(category, prompt) pairs from the templates, shuffled."""
    out: list[tuple[str, str]] = []
    for t in TOPICS:
        out += [("writing", f"Write a short blog post about {t}."),
                ("writing", f"Write a poem about {t}."),
                ("writing", f"Write a short story in which a character discovers something surprising about {t}."),
                ("qa", f"What should a beginner know about {t}?"),
                ("humanities", f"Discuss why {t} matters to society today."),
                ("writing", f"Write an email to a friend recommending they learn more about {t}."),
                ("extraction", f"List five key facts about {t} as bullet points.")]
    for p in PERSONAS:
        out += [("roleplay", f"Pretend you are {p}. {q}") for q in rng.sample(QUESTIONS, 3)]
    for s in SCIENCE:
        out += [("stem", f"Explain {s} in simple terms."), ("stem", f"How does {s} affect everyday life?"),
                ("qa", f"What is {s}?")]
    for a, b in PAIRS:
        out += [("reasoning", f"Compare {a} and {b}. Which would you choose and why?"),
                ("stem", f"What are the main differences between {a} and {b}?")]
    for person in PEOPLE:
        out += [("humanities", f"Who was {person} and why are they remembered?"),
                ("qa", f"What was {person}'s most important achievement?")]
    for task in CODE_TASKS:
        out += [("coding", f"Write a Python function that {task}."),
                ("coding", f"Write a Python function that {task}, with a docstring and a short usage example.")]
    for s in SENTENCES:
        for lang in rng.sample(LANGUAGES, 2):
            out.append(("translation", f"Translate the following sentence into {lang}: {s}"))
    for _ in range(60):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        n, price = rng.randint(2, 12), rng.randint(2, 15)
        paid = (n * price // 10 + 1) * 10
        out.append(("math", f"{name} buys {n} {item} for ${price} each and pays with ${paid}. How much change "
                            f"does {name} get? Explain your reasoning step by step."))
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(("math", f"What is {a} times {b}? Show your work."))
    rng.shuffle(out)
    return out


CONTEXT_TASKS = [
    ("summarization", "Summarize: {text}"),
    ("summarization", "Summarize the following text in two or three sentences.\n\n{text}"),
    ("rag", "{text}\nWhat is the main point of the text above?"),
    ("rag", "{text}\nAccording to the text above, what should a reader remember?"),
    ("extraction", "Extract the key facts from the following text as a bulleted list.\n\n{text}"),
    ("writing", "Rewrite the following text in a more formal tone.\n\n{text}"),
    ("writing", "Edit the following text to make it shorter and clearer.\n\n{text}"),
]


def context_prompts(rng: random.Random, texts: list[str], n: int) -> list[tuple[str, str]]:
    """n (category, prompt) pairs, each a task from CONTEXT_TASKS about one of
    `texts`; every text is used before any is used again."""
    out: list[tuple[str, str]] = []
    order: list[str] = []
    while texts and len(out) < n:
        if not order:
            order = rng.sample(texts, len(texts))
        cat, task = rng.choice(CONTEXT_TASKS)
        out.append((cat, task.format(text=order.pop())))
    return out


def written_requests(turns: list[tuple[str, bool]], min_words: int = 4) -> list[str]:
    """The user turns the target wrote, (text, ended) each, that make requests:
    ended within their token limit (a cut one is half a request), at least
    `min_words` words, each once, in order."""
    out: list[str] = []
    seen: set[str] = set()
    for text, ended in turns:
        text = text.strip()
        if ended and len(text.split()) >= min_words and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def dev_split(path: Path, held_out: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training, validation) (category, prompt) pairs from a Spec-Bench JSONL:
    the first `held_out` rows of each category (what the benchmarks replay) are
    validation only."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen: dict[str, int] = defaultdict(int)
    train, valid = [], []
    for r in rows:
        cat = r["category"]
        (valid if seen[cat] < held_out else train).append((cat, r["turns"][0]))
        seen[cat] += 1
    return train, valid
