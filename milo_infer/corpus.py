"""Demonstrations, the way a task renders them, and loaders for the benchmark data sets.

Two ways in:

* ``load_corpus(path)`` + ``task_from_corpus(demos, template=..., anchor=...)``: a user's own JSONL or
  CSV with ``input`` and ``output`` fields, no code needed.
* ``load_dataset(name)`` for the benchmark sets kept in ``../shared/data`` (or ``$MILO_DATA``):
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
import io
import json
import logging
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from milo_infer.scoring import extract_number

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
GENERIC_TEMPLATE = "Input: {input}\nOutput: {output}\n\n"
# An anchor lists the labels only when there are few enough to read at a glance.
MAX_LABELS_IN_ANCHOR = 20

_FIELD = re.compile(r"\{(input|output)\}")
# What makes a user's output numeric: a bare number, or a stated "answer is N" / "#### N".
_NUMERIC_OUTPUT = re.compile(r"\s*-?\$?[\d,]*\.?\d+\s*|.*(answer is|####).*", re.IGNORECASE | re.DOTALL)


class CorpusError(ValueError):
    """A corpus file that cannot be read as demonstrations; the message names the file and line."""


class DatasetUnavailable(FileNotFoundError):
    """The benchmark data is not on this machine; tests turn this into a skip with the reason."""


@dataclass(frozen=True)
class Demonstration:
    """One input/output pair. ``id`` is unique within its corpus and stable across loads."""

    input: str
    output: str
    id: str


@dataclass(frozen=True)
class TaskSpec:
    """How a task's demonstrations and queries are written, and what kind of answer it expects.

    ``template`` holds ``{input}`` then ``{output}`` (no other fields; other braces are literal).
    The query is the template cut just before ``{output}``, trailing spaces removed, so the model's
    continuation is the answer. ``anchor`` is the instruction text put before all demonstrations.
    ``answer_kind`` is "label" (one of ``labels``) or "number".
    """

    name: str
    template: str
    anchor: str
    answer_kind: str
    labels: tuple[str, ...] = field(default=())

    def __post_init__(self):
        fields = _FIELD.findall(self.template)
        if fields != ["input", "output"]:
            raise ValueError(
                f"task {self.name!r}: template must contain {{input}} then {{output}}, once each; got {self.template!r}"
            )
        if self.answer_kind not in ("label", "number"):
            raise ValueError(f"task {self.name!r}: answer_kind must be 'label' or 'number', not {self.answer_kind!r}")
        if self.answer_kind == "label" and not self.labels:
            raise ValueError(f"task {self.name!r}: a label task needs its list of labels")

    @property
    def query_prefix(self) -> str:
        """The template up to the output, e.g. ``"Query: {input}\\nIntent:"``."""
        return self.template[: self.template.index("{output}")].rstrip(" ")

    def render(self, demo: Demonstration) -> str:
        """The demonstration written out with the template."""
        return _fill(self.template, {"input": demo.input, "output": demo.output})

    def render_query(self, text: str) -> str:
        """A query written like a demonstration whose output the model is to continue."""
        return _fill(self.query_prefix, {"input": text})

    def answer_of(self, text: str) -> str | None:
        """The answer a demonstration output or a generation states, in canonical form.

        For labels: the first line, stripped. For numbers: `milo_infer.scoring.extract_number`'s
        reading (the number after the last "answer is", else the last number), written without
        thousands separators or a trailing ".0"; None if there is none.
        """
        if self.answer_kind == "label":
            return text.strip().split("\n", 1)[0].strip()
        value = extract_number(text)
        return None if value is None else _canonical_number(value)


def _fill(template: str, values: dict[str, str]) -> str:
    # One pass, so a "{output}" inside the input text stays text.
    return _FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def _canonical_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# --- user corpora --------------------------------------------------------------------------------

def load_corpus(path: str | os.PathLike) -> list[Demonstration]:
    """Read demonstrations from a ``.jsonl`` or ``.csv`` file with ``input`` and ``output`` fields.

    ``id`` is optional (a string or an integer); missing ids default to the 1-based row number.
    Other fields are ignored. Blank JSONL lines are not rows. Any bad row raises `CorpusError` with
    the file and line: rows are never dropped silently.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such corpus file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise CorpusError(f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x}); save the file as UTF-8") from None
    if not text.strip():
        raise CorpusError(f"{path}: the corpus is empty (no rows)")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path, text)
    elif suffix == ".csv":
        rows = _csv_rows(path, text)
    else:
        raise CorpusError(f"{path}: unknown corpus format {suffix!r}; use .jsonl or .csv")
    demos, seen = [], {}
    for number, (line, row) in enumerate(rows, start=1):
        demo = _demonstration(path, line, row, default_id=str(number))
        if demo.id in seen:
            raise CorpusError(f"{path}:{line}: duplicate id {demo.id!r} (first on line {seen[demo.id]})")
        seen[demo.id] = line
        demos.append(demo)
    if not demos:
        raise CorpusError(f"{path}: the corpus is empty (no rows)")
    return demos


def _jsonl_rows(path: Path, text: str):
    for line, content in enumerate(text.splitlines(), start=1):
        if not content.strip():
            continue
        try:
            row = json.loads(content)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}:{line}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise CorpusError(f"{path}:{line}: expected a JSON object with input and output, got {type(row).__name__}")
        yield line, row


def _csv_rows(path: Path, text: str):
    reader = csv.DictReader(io.StringIO(text, newline=""))
    header = reader.fieldnames or []
    missing = [name for name in ("input", "output") if name not in header]
    if missing:
        raise CorpusError(f"{path}:1: the CSV header {header} lacks column(s) {', '.join(missing)}")
    for row in reader:
        if None in row:
            raise CorpusError(f"{path}:{reader.line_num}: more fields than the header's {len(header)}")
        yield reader.line_num, {key: value for key, value in row.items() if value is not None}


def _demonstration(path: Path, line: int, row: dict, default_id: str) -> Demonstration:
    values = {}
    for name in ("input", "output"):
        if name not in row:
            raise CorpusError(f"{path}:{line}: missing field {name!r}")
        value = row[name]
        if not isinstance(value, str):
            raise CorpusError(f"{path}:{line}: field {name!r} must be a string, got {type(value).__name__} {value!r}")
        if not value.strip():
            raise CorpusError(f"{path}:{line}: field {name!r} is empty")
        values[name] = value
    ident = row.get("id")
    if ident is None or ident == "":
        ident = default_id
    elif isinstance(ident, bool) or not isinstance(ident, (str, int)):
        raise CorpusError(f"{path}:{line}: field 'id' must be a string or an integer, got {type(ident).__name__}")
    return Demonstration(input=values["input"], output=values["output"], id=str(ident))


def task_from_corpus(demos: list[Demonstration], template: str | None = None, anchor: str | None = None,
                     name: str = "custom") -> TaskSpec:
    """A `TaskSpec` for a user's corpus: numbers if every output states one, else labels.

    Labels are the distinct outputs, in order of first appearance. The default anchor lists them
    when there are at most `MAX_LABELS_IN_ANCHOR`.
    """
    if not demos:
        raise ValueError("task_from_corpus needs at least one demonstration")
    numeric = all(_NUMERIC_OUTPUT.fullmatch(d.output) and extract_number(d.output) is not None for d in demos)
    if numeric:
        return TaskSpec(name, template or GENERIC_TEMPLATE, anchor if anchor is not None else "", "number")
    labels = tuple(dict.fromkeys(d.output.strip() for d in demos))
    if anchor is None:
        anchor = _label_anchor("Give the label of each input", labels)
    return TaskSpec(name, template or GENERIC_TEMPLATE, anchor, "label", labels)


def _label_anchor(instruction: str, labels: tuple[str, ...]) -> str:
    if len(labels) <= MAX_LABELS_IN_ANCHOR:
        return f"{instruction}, one of: {', '.join(labels)}.\n\n"
    return f"{instruction}.\n\n"


# --- benchmark data sets -------------------------------------------------------------------------

def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir``, else ``$MILO_DATA``, else ``shared/data`` beside the repository."""
    if data_dir is not None:
        return Path(data_dir)
    if os.environ.get("MILO_DATA"):
        return Path(os.environ["MILO_DATA"])
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def load_dataset(name: str, *, seed: int = 0, data_dir: str | os.PathLike | None = None
                 ) -> tuple[list[Demonstration], list[Demonstration], TaskSpec]:
    """``(train, test, task)`` for a benchmark set; see the module docstring for splits and labels."""
    loaders = {"banking77": _banking77, "clinc150": _clinc150, "trec": _trec_coarse,
               "trec-fine": _trec_fine, "svamp": _svamp, "gsm8k": _gsm8k}
    if name not in loaders:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    root = data_root(data_dir)
    if not root.is_dir():
        raise DatasetUnavailable(f"data folder {root} does not exist (set MILO_DATA or pass data_dir)")
    train, test, task = loaders[name](root)
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
        anchor = _label_anchor("Classify each question by the type of its answer", labels)
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
        answer = _canonical_number(problem["Answer"])
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
            final = _canonical_number(float(answer.strip().replace(",", "")))
            demos.append(Demonstration(row["question"], f"{reasoning}\nThe answer is {final}.", f"{split}-{line}"))
        return demos
    return read("train"), read("test"), TaskSpec("gsm8k", MATH_TEMPLATE, MATH_ANCHOR, "number")
