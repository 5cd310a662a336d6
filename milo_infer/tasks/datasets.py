"""Loaders for the benchmark data sets, into `corpus.Demonstration` and `corpus.TaskSpec`.

``load_dataset(name)`` reads the sets kept in ``../shared/data`` (or ``$MILO_DATA``):
``banking77``, ``clinc150``, ``trec``, ``trec-fine``, ``svamp``, ``gsm8k``.

Splits and choices (also what results should report):

* Banking77, CLINC150 (in-scope ``train``/``test``; ``val`` and out-of-scope rows unused), TREC and
  GSM8K keep their official train/test splits. ``seed`` shuffles both lists, so a caller that takes
  the first N demonstrations or test items gets a seeded random sample.
* SVAMP has no split: a seeded permutation puts ``SVAMP_TEST_SIZE`` (300) problems in test and the
  other 700 in train.
* Labels are made readable: underscores become spaces and case is lowered ("Refund_not_showing_up"
  -> "refund not showing up"). TREC coarse codes become words ("NUM" -> "number"); fine labels
  become a readable name of the fine class alone ("NUM:date" -> "date", "HUM:ind" -> "individual"),
  qualified only where the bare name would be ambiguous ("LOC:other" -> "other location",
  "HUM:desc" -> "person description"). A TREC line whose fine label is not one of the 50 UIUC
  classes (train line 4451, ``NUM:How``) is skipped and the count logged.
* Math outputs end in "The answer is N." (`TaskSpec.answer_of` reads N back). GSM8K keeps its
  reasoning with the ``<<48/2=24>>`` calculator notes removed. SVAMP's reasoning is its equation:
  ``"76 - 25 = 51. The answer is 51."``; its input is Body, a space, and Question, as published.
"""
from __future__ import annotations

import csv
import json
import logging
import os
import random
import re
from pathlib import Path

from .corpus import Demonstration, TaskSpec, canonical_number, label_anchor

log = logging.getLogger(__name__)

DATASETS = ("banking77", "clinc150", "trec", "trec-fine", "svamp", "gsm8k")
SVAMP_TEST_SIZE = 300

TREC_COARSE = {"ABBR": "abbreviation", "DESC": "description", "ENTY": "entity",
               "HUM": "human", "LOC": "location", "NUM": "number"}
TREC_FINE = {
    "ABBR": {"abb": "abbreviation", "exp": "expansion"},
    "DESC": {"def": "definition", "desc": "description", "manner": "manner", "reason": "reason"},
    "ENTY": {"animal": "animal", "body": "body part", "color": "color", "cremat": "creative work",
             "currency": "currency", "dismed": "disease or medicine", "event": "event", "food": "food",
             "instru": "musical instrument", "lang": "language", "letter": "letter", "other": "other entity",
             "plant": "plant", "product": "product", "religion": "religion", "sport": "sport",
             "substance": "substance", "symbol": "symbol", "techmeth": "technique or method",
             "termeq": "equivalent term", "veh": "vehicle", "word": "word"},
    "HUM": {"gr": "group", "ind": "individual", "title": "title", "desc": "person description"},
    "LOC": {"city": "city", "country": "country", "mount": "mountain", "other": "other location",
            "state": "state"},
    "NUM": {"code": "code", "count": "count", "date": "date", "dist": "distance", "money": "money",
            "ord": "rank", "other": "other number", "perc": "percentage", "period": "period of time",
            "speed": "speed", "temp": "temperature", "volsize": "size", "weight": "weight"},
}

CLASSIFY_TEMPLATE = "Query: {input}\nIntent: {output}\n\n"
TREC_TEMPLATE = "Question: {input}\nType: {output}\n\n"
MATH_TEMPLATE = "Question: {input}\nAnswer: {output}\n\n"
MATH_ANCHOR = 'Solve each math word problem step by step, and end with "The answer is N."\n\n'

class DatasetUnavailable(FileNotFoundError):
    """The benchmark data is not on this machine; tests turn this into a skip with the reason."""


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir``, else ``$MILO_DATA``, else ``shared/data`` beside the repository."""
    if data_dir is not None:
        return Path(data_dir)
    if os.environ.get("MILO_DATA"):
        return Path(os.environ["MILO_DATA"])
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def load_dataset(name: str, *, seed: int = 0, data_dir: str | os.PathLike | None = None, shuffle: bool = True
                 ) -> tuple[list[Demonstration], list[Demonstration], TaskSpec]:
    """``(train, test, task)`` for a benchmark set; see the module docstring for splits and labels.
    ``shuffle=False`` keeps the files' order (a query stream as it was published, e.g. for cache hit rates)."""
    loaders = {"banking77": _banking77, "clinc150": _clinc150, "trec": _trec_coarse,
               "trec-fine": _trec_fine, "svamp": _svamp, "gsm8k": _gsm8k}
    if name not in loaders:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    root = data_root(data_dir)
    if not root.is_dir():
        raise DatasetUnavailable(f"data folder {root} does not exist (set MILO_DATA or pass data_dir)")
    train, test, task = loaders[name](root)
    if shuffle:
        rng = random.Random(seed)
        rng.shuffle(train)
        rng.shuffle(test)
    return train, test, task


def _need(root: Path, relative: str) -> Path:
    path = root / relative
    if not path.is_file():
        raise DatasetUnavailable(f"missing data file {path}")
    return path


def _readable(label: str) -> str:
    return label.replace("_", " ").lower()


def _banking77(root: Path):
    def read(split):
        with _need(root, f"banking77/banking_data/{split}.csv").open(encoding="utf-8", newline="") as handle:
            return [Demonstration(row["text"], _readable(row["category"]), f"{split}-{i}")
                    for i, row in enumerate(csv.DictReader(handle), start=1)]
    categories = json.loads(_need(root, "banking77/banking_data/categories.json").read_text(encoding="utf-8"))
    labels = tuple(_readable(c) for c in categories)
    task = TaskSpec("banking77", CLASSIFY_TEMPLATE, "Classify each banking customer query by its intent.\n\n",
                    "label", labels)
    return read("train"), read("test"), task


def _clinc150(root: Path):
    data = json.loads(_need(root, "clinc150/data/data_full.json").read_text(encoding="utf-8"))

    def read(split):
        return [Demonstration(text, _readable(intent), f"{split}-{i}")
                for i, (text, intent) in enumerate(data[split], start=1)]
    train = read("train")
    labels = tuple(sorted({d.output for d in train}))
    task = TaskSpec("clinc150", CLASSIFY_TEMPLATE,
                    "Classify each request to a virtual assistant by its intent.\n\n", "label", labels)
    return train, read("test"), task


def _trec(root: Path, fine: bool):
    def read(split, filename):
        path = _need(root, f"trec/{filename}")
        demos, malformed = [], []
        for line, content in enumerate(path.read_text(encoding="latin-1").splitlines(), start=1):
            if not content.strip():
                continue
            label, _, question = content.partition(" ")
            coarse, _, sub = label.partition(":")
            if sub not in TREC_FINE.get(coarse, {}) or not question.strip():
                malformed.append(line)
                continue
            output = TREC_FINE[coarse][sub] if fine else TREC_COARSE[coarse]
            demos.append(Demonstration(question.strip(), output, f"{split}-{line}"))
        if malformed:
            log.warning("%s: skipped %d malformed line(s) (unknown label): %s", path, len(malformed), malformed)
        return demos
    if fine:
        labels = tuple(name for group in TREC_FINE.values() for name in group.values())
        anchor = "Classify each question by the kind of answer it asks for.\n\n"
    else:
        labels = tuple(TREC_COARSE.values())
        anchor = label_anchor("Classify each question by the type of its answer", labels)
    task = TaskSpec("trec-fine" if fine else "trec", TREC_TEMPLATE, anchor, "label", labels)
    return read("train", "train_5500.label"), read("test", "TREC_10.en.label"), task


def _trec_coarse(root: Path):
    return _trec(root, fine=False)


def _trec_fine(root: Path):
    return _trec(root, fine=True)


def _svamp(root: Path):
    problems = json.loads(_need(root, "svamp/SVAMP.json").read_text(encoding="utf-8"))
    demos = []
    for problem in problems:
        answer = canonical_number(problem["Answer"])
        equation = _strip_outer_parens(re.sub(r"(\d)\.0\b", r"\1", problem["Equation"].strip()))
        demos.append(Demonstration(f"{problem['Body'].strip()} {problem['Question'].strip()}",
                                   f"{equation} = {answer}. The answer is {answer}.", problem["ID"]))
    # A fixed permutation (seed 0), independent of load_dataset's seed: the test set never moves.
    order = random.Random(0).sample(range(len(demos)), len(demos))
    test = [demos[i] for i in order[:SVAMP_TEST_SIZE]]
    train = [demos[i] for i in order[SVAMP_TEST_SIZE:]]
    return train, test, TaskSpec("svamp", MATH_TEMPLATE, MATH_ANCHOR, "number")


def _strip_outer_parens(expression: str) -> str:
    """``"( 76 - 25 )"`` -> ``"76 - 25"``, but ``"( 1 + 2 ) * ( 3 + 4 )"`` is left alone."""
    while expression.startswith("(") and expression.endswith(")"):
        depth = 0
        for position, char in enumerate(expression):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0 and position < len(expression) - 1:
                return expression
        expression = expression[1:-1].strip()
    return expression


def _gsm8k(root: Path):
    def read(split):
        path = _need(root, f"gsm8k/grade_school_math/data/{split}.jsonl")
        demos = []
        for line, content in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            row = json.loads(content)
            reasoning, _, answer = row["answer"].rpartition("####")
            reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()
            final = canonical_number(float(answer.strip().replace(",", "")))
            demos.append(Demonstration(row["question"], f"{reasoning}\nThe answer is {final}.", f"{split}-{line}"))
        return demos
    return read("train"), read("test"), TaskSpec("gsm8k", MATH_TEMPLATE, MATH_ANCHOR, "number")
