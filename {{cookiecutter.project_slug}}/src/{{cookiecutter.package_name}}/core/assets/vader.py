"""The VADER movie-review sentiment set, as train/validation/test CSV files.

Source: Hutto & Gilbert, "VADER: A Parsimonious Rule-based Model for Sentiment Analysis of Social Media Text", ICWSM 2014
(MIT licence), in the sdist of ``vaderSentiment==3.3.2`` (not the wheel): 10,605 tab-separated rows ``id, mean rating in
[-4, 4], text``.  Label = the rating's sign; the 37 rows rated 0 are dropped (10,568 left), split 80/10/10 with a seed.
"""

from __future__ import annotations

import csv
import io
import json
import random
import tarfile
from pathlib import Path

from ..errors import FetchError
from .pypi import install_once, pip_download

REQUIREMENT = "vaderSentiment==3.3.2"
INNER_ARCHIVE = "additional_resources/hutto_ICWSM_2014.tar.gz"
GROUND_TRUTH = "movieReviewSnippets_GroundTruth.txt"
SPLITS = (("train", 0.8), ("validation", 0.1), ("test", 0.1))
COLUMNS = ("id", "rating", "text", "label")


def parse_ground_truth(text: str) -> list[dict[str, str]]:
    """Parse the ground-truth file into rows with a sign label, dropping rating-0 rows.

    Raises:
        FetchError: a line does not have the three tab-separated fields.
    """
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t", 2)
        if len(fields) != 3:
            raise FetchError(f"{GROUND_TRUTH} line {number}: expected 'id<TAB>rating<TAB>text', got {line[:80]!r}")
        row_id, rating, sentence = fields
        if float(rating) == 0:
            continue
        label = "positive" if float(rating) > 0 else "negative"
        rows.append({"id": row_id, "rating": rating, "text": sentence.strip(), "label": label})
    return rows


def split_rows(rows: list[dict[str, str]], split_seed: int) -> dict[str, list[dict[str, str]]]:
    """Shuffle with ``split_seed`` and cut 80/10/10 (test takes the rounding remainder)."""
    shuffled = rows[:]
    random.Random(split_seed).shuffle(shuffled)
    n_train = int(len(shuffled) * SPLITS[0][1])
    n_val = int(len(shuffled) * SPLITS[1][1])
    return {
        "train": shuffled[:n_train],
        "validation": shuffled[n_train : n_train + n_val],
        "test": shuffled[n_train + n_val :],
    }


def fetch_vader_movie_reviews(out_dir: str, split_seed: int) -> Path:
    """Write ``out_dir/{train,validation,test}.csv`` once (:func:`.pypi.install_once`).

    Raises:
        FetchError: the download failed or the archive lacks the ground-truth file.
    """

    def build(staging: Path, scratch: Path) -> None:
        text = _read_ground_truth(pip_download(REQUIREMENT, scratch / "download", source=True))
        for split, rows in split_rows(parse_ground_truth(text), split_seed).items():
            with (staging / f"{split}.csv").open("w", newline="", encoding="utf-8") as file:
                writer = csv.DictWriter(file, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows(rows)

    return install_once(out_dir, build)


def fetch_vader_instructions(source_dir: str, split_seed: int, out_dir: str, instruction: str) -> Path:
    """The same splits as ``out_dir/{train,validation,test}.jsonl`` rows ``{"prompt": instruction.format(text=snippet),
    "completion": label}``, once (``source_dir``, ``split_seed``: :func:`fetch_vader_movie_reviews`).

    Raises:
        ValueError: ``instruction`` has no ``{text}`` field.  FetchError: as :func:`fetch_vader_movie_reviews`.
    """
    if "{text}" not in instruction:
        raise ValueError(f"data.fetch.instruction={instruction!r} has no {{text}} field for the snippet; fix: add one")

    def build(staging: Path, scratch: Path) -> None:
        source = fetch_vader_movie_reviews(source_dir, split_seed)
        for split, _ in SPLITS:
            with (source / f"{split}.csv").open(newline="", encoding="utf-8") as file:
                rows = [{"prompt": instruction.format(text=row["text"]), "completion": row["label"]} for row in csv.DictReader(file)]
            (staging / f"{split}.jsonl").write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")

    return install_once(out_dir, build)


def _read_ground_truth(sdist: Path) -> str:
    with tarfile.open(sdist) as outer:
        inner_member = next((m for m in outer.getmembers() if m.name.endswith(INNER_ARCHIVE)), None)
        if inner_member is None:
            raise FetchError(f"{sdist.name} has no {INNER_ARCHIVE}")
        inner_bytes = outer.extractfile(inner_member).read()
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        member = next((m for m in inner.getmembers() if m.name.endswith(GROUND_TRUTH)), None)
        if member is None:
            raise FetchError(f"{INNER_ARCHIVE} has no {GROUND_TRUTH}")
        return inner.extractfile(member).read().decode("utf-8")


# The preference demo's 10 x 20 = 200 prompts (template x genre): see review_prompts.
PROMPT_TEMPLATES = (
    "Write a one-sentence review of a {genre} movie.",
    "Describe a {genre} film you just watched, in one sentence.",
    "Give a short critic's blurb for a new {genre} movie.",
    "In one sentence, what did you think of the latest {genre} film?",
    "Write a movie-review snippet about a {genre} picture.",
    "Sum up a {genre} movie in a single review sentence.",
    "Share your one-line opinion of a {genre} film.",
    "Write a brief review of a {genre} movie you saw last night.",
    "Tell me in one sentence how a recent {genre} movie turned out.",
    "Write a short review snippet for a {genre} film festival entry.",
)
GENRES = (
    "action", "comedy", "drama", "horror", "romance", "science-fiction", "fantasy", "thriller", "mystery", "animated",
    "documentary", "western", "musical", "war", "crime", "family", "adventure", "sports", "historical", "superhero",
)  # fmt: skip


def review_prompts(prompt_seed: int) -> tuple[list[str], list[str]]:
    """``(training prompts, held-out prompts)``: every template x genre, shuffled with ``prompt_seed``, cut in halves."""
    prompts = [template.format(genre=genre) for template in PROMPT_TEMPLATES for genre in GENRES]
    random.Random(prompt_seed).shuffle(prompts)
    return prompts[:100], prompts[100:]


def fetch_vader_preferences(
    source_dir: str, split_seed: int, out_dir: str, prompt_seed: int, chosen_min: float, rejected_max: float
) -> Path:
    """Preference pairs, once: ``out_dir/{train,validation,test}.jsonl`` rows ``{"prompt", "chosen", "rejected"}`` (per split,
    snippets rated ``>= chosen_min`` and ``<= rejected_max`` shuffled and paired; a :func:`review_prompts` prompt each, the
    held-out half for test) and ``out_dir/prompts.jsonl`` (the 100 held-out prompts).

    Raises:
        FetchError: as :func:`fetch_vader_movie_reviews`.
    """

    def build(staging: Path, scratch: Path) -> None:
        source = fetch_vader_movie_reviews(source_dir, split_seed)
        seen, held_out = review_prompts(prompt_seed)
        for number, (split, _) in enumerate(SPLITS):
            with (source / f"{split}.csv").open(newline="", encoding="utf-8") as file:
                rows = list(csv.DictReader(file))
            rng = random.Random(prompt_seed * 1000 + number)
            chosen = [row["text"] for row in rows if float(row["rating"]) >= chosen_min]
            rejected = [row["text"] for row in rows if float(row["rating"]) <= rejected_max]
            rng.shuffle(chosen)
            rng.shuffle(rejected)
            prompts = held_out if split == "test" else seen
            pairs = [{"prompt": rng.choice(prompts), "chosen": good, "rejected": bad} for good, bad in zip(chosen, rejected)]
            (staging / f"{split}.jsonl").write_text(
                "".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs), encoding="utf-8"
            )
        (staging / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held_out), encoding="utf-8")

    return install_once(out_dir, build)


def sentiment_scores(texts: list[str]) -> list[dict[str, float]]:
    """Per text, VADER's score (``SentimentIntensityAnalyzer``, Hutto & Gilbert 2014): ``vader_compound`` in [-1, 1], and
    ``positive_share`` 1.0 when it is >= 0.05 (the authors' positive threshold), else 0.0.

    Raises:
        ImportError: vaderSentiment is not installed (the ``judge`` extra).
    """
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as error:
        raise ImportError('the VADER judge needs the vaderSentiment package; fix: pip install -e ".[judge]"') from error
    analyzer = SentimentIntensityAnalyzer()
    scores = []
    for text in texts:
        compound = analyzer.polarity_scores(text)["compound"]
        scores.append({"vader_compound": compound, "positive_share": float(compound >= 0.05)})
    return scores
