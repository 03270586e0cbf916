"""Built-in demo data, generated deterministically with num2words: no download needed.

Translation: short English sentences with numbers written out, to German. German writes units before tens and joins
the whole number into one word ("three hundred and forty-two" -> "dreihundertzweiundvierzig"), and some templates
move words around ("the train leaves in ten minutes" -> "der Zug fährt in zehn Minuten ab"), so the model has to
learn reordering, not a word-by-word mapping.

Language modelling: English sentences about numbers ("forty-two plus seven is forty-nine."), whose arithmetic makes
the next word predictable from the context.
"""

import functools
import random

from datasets import Dataset, DatasetDict
from num2words import num2words

# (English, German) templates; {a} and {b} are numbers >= 2 (so every noun is plural), {year} a year.
TEMPLATES: list[tuple[str, str]] = [
    ("{a}", "{a}"),
    ("she has {a} books", "sie hat {a} Bücher"),
    ("we need {a} chairs and {b} tables", "wir brauchen {a} Stühle und {b} Tische"),
    ("the train leaves in {a} minutes", "der Zug fährt in {a} Minuten ab"),
    ("{a} people live here", "hier wohnen {a} Menschen"),
    ("I am {a} years old", "ich bin {a} Jahre alt"),
    ("he was born in {year}", "er wurde {year} geboren"),
    ("{a} plus {b} is {sum}", "{a} plus {b} ist {sum}"),
]


def _numbers(rng: random.Random) -> dict[str, int]:
    # Mostly small numbers, sometimes up to the thousands, as in running text.
    a, b = (rng.choice([rng.randint(2, 99), rng.randint(2, 999), rng.randint(2, 9999)]) for _ in range(2))
    return {"a": a, "b": b, "sum": a + b, "year": rng.randint(1100, 2099)}


@functools.lru_cache(maxsize=None)  # num2words takes ~0.2 ms a call; the same numbers come back often
def spell_number(value: int, lang: str = "en", to: str = "cardinal") -> str:
    return num2words(value, lang=lang, to=to)


def _spell(template: str, numbers: dict[str, int], lang: str) -> str:
    words = {name: spell_number(value, lang) for name, value in numbers.items() if name != "year"}
    words["year"] = spell_number(numbers["year"], lang, to="year")
    return template.format(**words)


def translation_pair(rng: random.Random) -> dict[str, str]:
    english, german = rng.choice(TEMPLATES)
    numbers = _numbers(rng)
    return {"en": _spell(english, numbers, "en"), "de": _spell(german, numbers, "de")}


def number_translation_dataset(num_train: int = 20000, num_validation: int = 500, seed: int = 1234) -> DatasetDict:
    """English -> German number sentences as a `translation` column ({"en": ..., "de": ...}), like WMT on the Hub.

    Validation sentences never occur in the training split.
    """
    rng = random.Random(seed)
    validation: dict[str, dict[str, str]] = {}
    while len(validation) < num_validation:
        pair = translation_pair(rng)
        validation[pair["en"]] = pair
    train = []
    while len(train) < num_train:
        pair = translation_pair(rng)
        if pair["en"] not in validation:
            train.append(pair)
    return DatasetDict(
        train=Dataset.from_dict({"translation": train}),
        validation=Dataset.from_dict({"translation": list(validation.values())}),
    )


def arithmetic_sentence(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    operation = rng.choice(["plus", "minus", "times"])
    result = {"plus": a + b, "minus": a - b, "times": a * b}[operation]
    return f"{spell_number(a)} {operation} {spell_number(b)} is {spell_number(result)}."


def arithmetic_text_dataset(num_train: int = 20000, num_validation: int = 500, seed: int = 1234) -> DatasetDict:
    """A `text` column of English arithmetic sentences for causal language modelling."""
    rng = random.Random(seed)
    texts = [arithmetic_sentence(rng) for _ in range(num_train + num_validation)]
    return DatasetDict(
        train=Dataset.from_dict({"text": texts[:num_train]}),
        validation=Dataset.from_dict({"text": texts[num_train:]}),
    )


__all__ = ["number_translation_dataset", "arithmetic_text_dataset", "translation_pair", "TEMPLATES"]
