"""Built-in data for the pretrain -> fine-tune demo: a synthetic language whose labels depend on structure that
unlabelled text reveals, so that what pretraining buys can be measured in minutes on a CPU.

The language: content words belong to hidden topics (TOPICS of WORDS_PER_TOPIC made-up words each, e.g. "bavo",
"kelu"); every sentence is about one topic: its content words come from that topic, except for a few from other
topics (noise), mixed with function words shared by all topics. The label of a sentence is its topic.

Why pretraining helps here: a labelled set of a few dozen sentences shows each content word about once, so a
classifier trained from scratch cannot know the topic of most words in a new sentence. The unlabelled text shows
which words occur together, which is exactly the topic structure: a language model (masked or causal) has to learn
it to predict the missing or next word, and its embeddings and states then carry the topic for fine-tuning to read.
"""

import random
from dataclasses import dataclass

from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

TOPICS = 4
WORDS_PER_TOPIC = 60
FUNCTION_WORDS = "the a of to and in is was it that on for with as at by from this".split()
SYLLABLES = [consonant + vowel for consonant in "bdfgklmnprstvz" for vowel in "aeiou"]
# Special tokens in the ids the model config expects (pad 0, bos 1, eos 2), and a mask token for the masked LM.
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
MASK_TOKEN = "<mask>"


@dataclass(frozen=True)
class TopicLanguage:
    """The vocabulary of the language and how sentences are drawn from it."""

    topic_words: tuple[tuple[str, ...], ...]
    function_word_rate: float = 0.4  # share of function words in a sentence
    off_topic_rate: float = 0.25  # share of content words drawn from another topic
    min_length: int = 8
    max_length: int = 14

    @classmethod
    def build(cls, seed: int = 1234) -> "TopicLanguage":
        """TOPICS x WORDS_PER_TOPIC distinct two-syllable words, assigned to topics at random."""
        rng = random.Random(seed)
        words = sorted({a + b for a in SYLLABLES for b in SYLLABLES})
        chosen = rng.sample(words, TOPICS * WORDS_PER_TOPIC)
        return cls(tuple(tuple(chosen[t::TOPICS]) for t in range(TOPICS)))

    @property
    def label_names(self) -> list[str]:
        return [f"topic_{t}" for t in range(TOPICS)]

    def sentence(self, topic: int, rng: random.Random) -> str:
        words = []
        for _ in range(rng.randint(self.min_length, self.max_length)):
            if rng.random() < self.function_word_rate:
                words.append(rng.choice(FUNCTION_WORDS))
                continue
            source = topic if rng.random() >= self.off_topic_rate else rng.randrange(TOPICS)
            words.append(rng.choice(self.topic_words[source]))
        return " ".join(words)

    def examples(self, count: int, seed: int) -> dict[str, list]:
        """`count` sentences with balanced topics, shuffled: {"text": [...], "label": [...]}."""
        rng = random.Random(seed)
        labels = [i % TOPICS for i in range(count)]
        rng.shuffle(labels)
        return {"text": [self.sentence(label, rng) for label in labels], "label": labels}

    def vocabulary(self) -> list[str]:
        return [*SPECIAL_TOKENS.values(), MASK_TOKEN, *FUNCTION_WORDS, *(w for ws in self.topic_words for w in ws)]


def unlabelled_text(train_size: int, validation_size: int, seed: int = 0) -> DatasetDict:
    """Pretraining text: sentences of the language, a "text" column only."""
    language = TopicLanguage.build()
    return DatasetDict(
        train=Dataset.from_dict({"text": language.examples(train_size, seed)["text"]}),
        validation=Dataset.from_dict({"text": language.examples(validation_size, seed + 1)["text"]}),
    )


def labelled_topics(train_size: int, validation_size: int, seed: int = 100) -> DatasetDict:
    """The fine-tuning task: "text" and its topic, "label" (a ClassLabel with the topic names). Drawn with seeds
    apart from the pretraining text's, so the labelled sentences are new sentences."""
    language = TopicLanguage.build()
    features = Features({"text": Value("string"), "label": ClassLabel(names=language.label_names)})
    splits = {"train": language.examples(train_size, seed), "validation": language.examples(validation_size, seed + 1)}
    return DatasetDict({split: Dataset.from_dict(columns, features=features) for split, columns in splits.items()})


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the language's vocabulary: "<s> words </s>", pad 0, bos 1, eos 2, mask 4."""
    vocab = {token: i for i, token in enumerate(TopicLanguage.build().vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos, eos = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        mask_token=MASK_TOKEN,
        model_input_names=["input_ids", "attention_mask"],
        **SPECIAL_TOKENS,
    )
